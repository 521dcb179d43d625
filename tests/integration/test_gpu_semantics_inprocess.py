"""The guards' hot path under the CUDA simulator, on SGLang's real allocator and KV pool, in one process: run under a
pin venv (tests/unit/test_cudasim.py tests the simulator itself).

Every tensor SGLang would place on the GPU is a simulated device tensor here: reading it on the host is a counted
host synchronisation, and a device->host copy into pinned memory holds poison until its event is waited for or
seen complete. Asserted, each time with the hazard shown first where there is one:

- prefill's source hold (0.5.21+ hands the chunk's page indices over while they are still being copied): read
  before the copy lands they name the wrong pages (shown with the naive read); the hook reads them only once the
  event is seen complete (the transfer worker's wait, or a query) and holds the right pages, with no poisoned read
  and no host synchronisation by sglang-harden;
- decode's free path: the free of a request whose transfer may still write is kept back whole and the transfer's
  pages quarantined, a committed request's free passes, and the ledger learns of it from an asynchronous copy --
  none of it reads the freed index (0 host syncs by sglang-harden); a free nobody can attribute while a transfer
  is in flight is read, and the simulator counts that sync (the counter sees sglang-harden);
- the commit gate: canary stamps, the canary check, the page-table copy and the digest run on the device and are
  decided from landed copies: a clean transfer passes and an unwritten page fails it, with 0 host syncs and no
  thread wait by sglang-harden on the scheduler thread.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

from sglang_harden.compat import activate, free_path_v05, lifecycle_v05, page_tags_v05  # noqa: E402
from sglang_harden.compat.free_path_v05 import REQUEST, FreeContext, within  # noqa: E402
from sglang_harden.compat.lifecycle_nodes import DecodeNode  # noqa: E402
from sglang_harden.compat.prefill_node import PrefillNode  # noqa: E402
from sglang_harden.guards.lifecycle import PageState  # noqa: E402
from sglang_harden.testbed import cudasim  # noqa: E402

POOL = 64
ROOM_A, ROOM_B = 8101, 8102


@pytest.fixture(scope="module", autouse=True)
def _hooks() -> None:
    activate("integration-test")
    from sglang.srt.mem_cache.allocator import token  # noqa: F401 - installs the free hooks


@pytest.fixture()
def sim() -> Any:
    with cudasim.session() as dev:
        yield dev
    lifecycle_v05.NODE = None


def harden_syncs() -> dict[str, int]:
    """Host syncs (and thread waits) sglang-harden made on this thread, by kind."""
    out: dict[str, int] = {}
    for (owner, kind, _site), n in cudasim.counts()["syncs"].items():
        if owner == "sglang_harden":
            out[kind] = out.get(kind, 0) + n
    return out


def harden_poisoned_reads() -> int:
    return sum(n for (owner, _op, _site), n in cudasim.counts()["poisoned"].items() if owner == "sglang_harden")


def _allocator(dev: Any) -> Any:
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    return TokenToKVPoolAllocator(POOL, torch.float16, dev, None, True)


def _host(tensor: Any) -> np.ndarray:
    """The test's own read of a device tensor (counted under the test's name, not sglang-harden's)."""
    return np.asarray(tensor.cpu().tolist(), dtype=np.int64)


# ------------------------------------------------------------------------------------- prefill source hold


def _indices_in_flight(dev: Any, pages: list[int]) -> tuple[Any, Any]:
    """What SGLang 0.5.21+ hands the sender: pinned page indices still being copied, and the copy's event."""
    on_device = torch.tensor(pages, dtype=torch.int64, device=dev)
    pinned = torch.empty(on_device.shape, dtype=on_device.dtype, device="cpu", pin_memory=True)
    pinned.copy_(on_device, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream())
    return pinned, event


def test_prefill_holds_the_source_pages_its_chunk_reads_once_their_copy_landed(sim: Any) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    pages = [5, 6, 9, 12]
    naive, _event = _indices_in_flight(sim, pages)
    assert naive.numpy().tolist() != pages, "read before its event, the copy names other pages (the hazard)"
    cudasim.reset()

    alloc = _allocator(sim)
    node = PrefillNode.for_allocator(alloc)
    lifecycle_v05.NODE = node
    indices, event = _indices_in_flight(sim, pages)
    mgr = SimpleNamespace(request_status={ROOM_A: KVPoll.Transferring}, transfer_infos={ROOM_A: {}},
                          _staging_outstanding={ROOM_A: 1})
    handed: list[dict[str, Any]] = []
    add = lifecycle_v05._hold_sources(lambda self, room, kv_indices, *a, **k: handed.append(k))
    add(mgr, ROOM_A, indices, slice(0, 4), True, indices_event=event)
    assert harden_poisoned_reads() == 0 and harden_syncs() == {}
    assert not node.held_room.any(), "nothing is read before the copy landed"

    worker = threading.Thread(target=handed[0]["indices_event"].synchronize)  # SGLang's transfer worker waits
    worker.start()
    worker.join(10)
    assert sorted(np.flatnonzero(node.held_room == ROOM_A).tolist()) == pages
    assert harden_poisoned_reads() == 0 and harden_syncs() == {}


def test_an_aborted_room_s_free_waits_for_its_transfer_to_settle(sim: Any) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    alloc = _allocator(sim)
    node = PrefillNode.for_allocator(alloc)
    lifecycle_v05.NODE = node
    src = alloc.alloc(8)
    mgr = SimpleNamespace(request_status={ROOM_A: KVPoll.Failed}, transfer_infos={ROOM_A: {}},
                          _staging_outstanding={ROOM_A: 1})
    node.hold(mgr, ROOM_A, _host(src))
    cudasim.reset()
    req = SimpleNamespace(bootstrap_room=ROOM_A)
    within(FreeContext(REQUEST, req), lambda: alloc.free(src))  # SGLang releases the aborted request
    assert alloc.available_size() == POOL - 8, "its pages stay out while a chunk may still read them"
    mgr._staging_outstanding[ROOM_A] = 0
    free_path_v05.free_loose_pages(node, node.settle_pending())
    free_path_v05.give_back(node.take_given_back())
    assert alloc.available_size() == POOL
    assert harden_syncs() == {}, "decided from the room's record, the freed index never read"


# ------------------------------------------------------------------------------------- decode free path


def _published(node: DecodeNode, room: int, slots: Any) -> None:
    receiver = SimpleNamespace(bootstrap_room=room, bootstrap_addr="127.0.0.1:8998", bootstrap_infos=[{}],
                               kv_mgr=SimpleNamespace(record_failure=lambda *a: None), abort=lambda: None,
                               _send_abort_notification=lambda: None, target_tp_ranks=[0], target_pp_ranks=[0],
                               target_cp_ranks=[0], prefill_info=SimpleNamespace(pp_size=1, attn_cp_size=1))
    lifecycle_v05._send_metadata(lambda self, kv_indices, *a, **k: None)(receiver, _host(slots))


def test_decode_frees_are_decided_without_reading_the_index(sim: Any) -> None:
    alloc = _allocator(sim)
    alloc.alloc(POOL - 16)  # a full pool: the next request is handed whatever was freed last
    vanilla_a = alloc.alloc(16)
    alloc.free(vanilla_a)  # vanilla: the pages of an in-flight transfer go straight back
    assert set(_host(alloc.alloc(16)).tolist()) == set(_host(vanilla_a).tolist())
    alloc = _allocator(sim)

    node = DecodeNode.for_allocator(alloc, cap=POOL)
    lifecycle_v05.NODE = node
    a, b = alloc.alloc(16), alloc.alloc(16)
    _published(node, ROOM_A, a)
    _published(node, ROOM_B, b)
    node.finish(ROOM_B)
    cudasim.reset()

    within(FreeContext(REQUEST, SimpleNamespace(bootstrap_room=ROOM_A)), lambda: alloc.free(a))  # an abort
    assert node.ledger.quarantined_count() == 16 and alloc.available_size() == POOL - 32
    within(FreeContext(REQUEST, SimpleNamespace(bootstrap_room=ROOM_B)), lambda: alloc.free(b))  # committed
    assert alloc.available_size() == POOL - 16
    node.apply_learned()
    assert node.ledger.state(int(_host(b)[0])) is PageState.FREE, "the ledger learned of the free from its copy"
    assert harden_syncs() == {} and harden_poisoned_reads() == 0

    node.note_ack(ROOM_A, 0)
    given, loose = node.confirmations()
    free_path_v05.give_back(given)
    free_path_v05.free_loose_pages(node, loose)
    assert alloc.available_size() == POOL and node.ledger.quarantined_count() == 0
    assert harden_syncs() == {}

    c = alloc.alloc(8)
    _published(node, ROOM_A + 10, c)
    cudasim.reset()
    alloc.free(c)  # nobody can say whose free this is while a transfer is in flight: the index is read
    assert harden_syncs(), "the simulator counts sglang-harden's read"
    assert node.ledger.quarantined_count() == 8


# ------------------------------------------------------------------------------------- decode commit gate


def _pool(dev: Any) -> Any:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(POOL, 1, torch.bfloat16, 2, 16, 2, dev, False)


def _gate_request(dev: Any, room: int, slots: list[int], receiver: Any) -> tuple[Any, Any]:
    table = torch.zeros((4, POOL), dtype=torch.int32, device=dev)
    table[1, : len(slots)] = torch.tensor(slots, dtype=torch.int32, device=dev)
    req = SimpleNamespace(rid=f"r{room}", bootstrap_room=room, origin_input_ids=list(range(len(slots))),
                          req_pool_idx=1, kv=None, prefix_indices=None, bootstrap_host="127.0.0.1")
    decode_req = SimpleNamespace(req=req, kv_receiver=receiver)
    queue = SimpleNamespace(queue=[decode_req], scheduler=SimpleNamespace(
        req_to_token_pool=SimpleNamespace(req_to_token=table)))
    return queue, decode_req


def _poll_until_decided(gate: Any, receiver: Any, queue: Any) -> Any:
    from sglang.srt.disaggregation.base.conn import KVPoll

    for _ in range(50):
        gate.see_queue(queue)
        status = gate.gate(receiver, KVPoll.Success)
        if status != KVPoll.Transferring:
            return status
    raise AssertionError("the gate never decided")


@pytest.mark.parametrize("unwritten", [False, True], ids=["clean", "one-page-unwritten"])
def test_commit_gate_decides_from_landed_copies(sim: Any, unwritten: bool) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    from sglang_harden.compat import kv_canary
    from sglang_harden.compat.commit_gate import wiring
    from sglang_harden.compat.gate import CommitGate
    from sglang_harden.compat.runtime import RUNTIME

    alloc = _allocator(sim)
    node = DecodeNode.for_allocator(alloc, cap=POOL)
    lifecycle_v05.NODE = node
    pool = _pool(sim)
    RUNTIME.decode_kv_pool = pool
    slots = alloc.alloc(6)
    host_slots = _host(slots).tolist()
    failures: list[str] = []
    receiver = SimpleNamespace(bootstrap_room=ROOM_B, bootstrap_addr="127.0.0.1:8998", bootstrap_infos=[{}],
                               kv_mgr=SimpleNamespace(record_failure=lambda room, why: failures.append(why)))
    cudasim.reset()
    kv_canary.stamp_before_send(lambda self, kv_indices, *a, **k: None)(receiver, np.array(host_slots))
    _published(node, ROOM_B, slots)
    written = host_slots[:-1] if unwritten else host_slots
    for buffers in (pool.k_buffer, pool.v_buffer):  # the transfer (an RDMA write: not stream-ordered)
        for layer in buffers:
            layer[written] = 1
    queue, _ = _gate_request(sim, ROOM_B, host_slots, receiver)
    gate = CommitGate(wiring())
    gate.join("page_tags", page_tags_v05.PageTagStep(), "page_tags")
    gate.join("canary", kv_canary.canary_step(), "canary")
    status = _poll_until_decided(gate, receiver, queue)
    assert status == (KVPoll.Failed if unwritten else KVPoll.Success), failures
    assert not unwritten or "canary check failed" in failures[0]
    assert harden_syncs() == {} and harden_poisoned_reads() == 0
