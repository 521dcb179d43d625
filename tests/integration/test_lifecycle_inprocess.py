"""Page lifecycle + page tags on real SGLang classes, in one process (no server): run under a pin venv.

The allocator is SGLang's own ``TokenToKVPoolAllocator`` with the compat hooks installed by ``activate()``;
the transfer path's wrappers (``send_metadata``, ``note_abort_ack``, ``pop_transferred``, the commit) are driven
with small stand-ins for the Mooncake receiver/manager, because those need a live peer. Asserted:

- vanilla: a page freed on abort while its transfer is in flight goes straight back to the free list and the
  next request is handed it (the late write would land in that request's KV);
- hardened: those pages are quarantined (not allocatable, visible, an ABORT asking for a drain ack goes out),
  leave quarantine only on the drain ack or when the sender is known gone, and the pool is full at quiesce;
- a completed transfer's pages free normally; at the quarantine cap the decode door answers 503;
- page tags: a page table with a page owned by someone else is refused (the commit aborts the request).
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang_harden import events  # noqa: E402
from sglang_harden.compat import activate, free_path_v05, lifecycle_v05, page_tags_v05  # noqa: E402
from sglang_harden.compat.backends import common as backends_common  # noqa: E402
from sglang_harden.compat.backends import mooncake as mooncake_backend  # noqa: E402
from sglang_harden.compat.backends import nixl as nixl_backend  # noqa: E402
from sglang_harden.compat.lifecycle_nodes import DecodeNode, owner_of_room  # noqa: E402
from sglang_harden.compat.prefill_node import PrefillNode  # noqa: E402
from sglang_harden.compat.runtime import RUNTIME  # noqa: E402
from sglang_harden.config import Mode  # noqa: E402
from sglang_harden.guards.base import Verdict  # noqa: E402
from sglang_harden.guards.lifecycle import PageState  # noqa: E402

POOL = 48
ROOM_A, ROOM_B = 7001, 7002


@pytest.fixture(scope="module")
def sglang_modules() -> dict[str, Any]:
    activate("integration-test")
    from sglang.srt.disaggregation import decode
    from sglang.srt.disaggregation.common import conn
    from sglang.srt.mem_cache.allocator import paged, token

    from sglang_harden.compat.hooks import is_in_place

    for hook in lifecycle_v05.HOOKS:
        if hook.module in (token.__name__, paged.__name__, decode.__name__, conn.__name__) and not hook.optional:
            assert is_in_place(hook), hook.target
    return {"token": token, "conn": conn, "decode": decode}


@pytest.fixture()
def allocator(sglang_modules: dict[str, Any]) -> Any:
    alloc = sglang_modules["token"].TokenToKVPoolAllocator(POOL, torch.float16, "cpu", None, True)
    yield alloc
    lifecycle_v05.NODE = None


GENERATION = 1  # the generation a stand-in receiver's abort notice carries (releases that number them, 0.5.22+)


def _numbered(conn: Any) -> bool:
    return "generation" in inspect.signature(conn.CommonKVManager.note_abort_ack).parameters


class Receiver:
    """Stands in for MooncakeKVReceiver where the wrappers read it: one prefill rank (TP rank 0) targeted."""

    def __init__(self, room: int) -> None:
        self.bootstrap_room = room
        self.bootstrap_addr = "127.0.0.1:8998"
        self.bootstrap_infos = [{"rank_ip": "127.0.0.1", "rank_port": 1}]
        self.target_tp_ranks, self.target_pp_ranks, self.target_cp_ranks = [0], [0], [0]
        self.prefill_info = SimpleNamespace(pp_size=1, attn_cp_size=1)
        self.abort_notified = False
        self.aborts_sent = 0
        self.kv_mgr = SimpleNamespace(record_failure=lambda *a: None)

    def _send_abort_notification(self) -> None:
        from sglang.srt.disaggregation.common import conn

        self.aborts_sent += 1
        if _numbered(conn):
            self._abort_generation = GENERATION

    def abort(self) -> None:
        self.abort_notified = True


def _publish(receiver: Receiver, indices: Any) -> None:
    wrapped = lifecycle_v05._send_metadata(lambda self, kv_indices, *a, **k: None)
    wrapped(receiver, indices.numpy())


def _ack(conn: Any, room: int) -> None:
    mgr = SimpleNamespace(_deferred_abort_ack_tracker={})
    params = inspect.signature(conn.CommonKVManager.note_abort_ack).parameters
    extra = {"generation": GENERATION} if "generation" in params else {}
    conn.CommonKVManager.note_abort_ack(mgr, room, 0, **extra)


def _scheduler_step(decode: Any) -> None:
    queue = SimpleNamespace(queue=[])
    decode.DecodeTransferQueue.pop_transferred(queue)


def test_vanilla_reuses_pages_of_an_in_flight_transfer(allocator: Any) -> None:
    lifecycle_v05.NODE = None
    filler = allocator.alloc(20)
    a = allocator.alloc(20)
    allocator.free(a)  # decode gives up on A; prefill's write into `a` is still in flight
    b = allocator.alloc(20)
    assert set(a.tolist()) & set(b.tolist()), "small pool: B is handed A's pages"
    allocator.free(filler)


def test_hardened_quarantines_until_drain_ack(allocator: Any, sglang_modules: dict[str, Any]) -> None:
    node = DecodeNode.for_allocator(allocator, cap=40)
    lifecycle_v05.NODE = node
    filler = allocator.alloc(20)
    a = allocator.alloc(20)
    receiver = Receiver(ROOM_A)
    _publish(receiver, a)
    assert node.ledger.state(int(a[0])) == PageState.WRITING

    allocator.free(a)  # abort/timeout release while the write may be in flight
    assert node.ledger.quarantined_count() == 20
    assert receiver.aborts_sent == 1, "decode asks prefill for a drain ack"
    assert allocator.available_size() == POOL - 40
    assert allocator.alloc(20) is None, "quarantined pages are not allocatable"
    assert node.report()["quarantined_pages"] == 20

    _scheduler_step(sglang_modules["decode"])
    assert node.ledger.quarantined_count() == 20, "no confirmation yet: stays quarantined (no timeout release)"

    _ack(sglang_modules["conn"], ROOM_A)
    _scheduler_step(sglang_modules["decode"])
    assert node.ledger.quarantined_count() == 0
    allocator.free(filler)
    assert allocator.available_size() == POOL, "every page back at quiesce"
    assert events.snapshot().get("lifecycle:quarantine", 0) >= 1


def test_sender_known_gone_releases_quarantine(allocator: Any, sglang_modules: dict[str, Any]) -> None:
    node = DecodeNode.for_allocator(allocator, cap=40)
    lifecycle_v05.NODE = node
    a = allocator.alloc(10)
    _publish(Receiver(ROOM_A), a)
    allocator.free(a)
    assert node.ledger.quarantined_count() == 10
    lifecycle_v05._note_gone(lambda self, addr: None)(None, "127.0.0.1:8998")  # heartbeat: prefill is gone
    _scheduler_step(sglang_modules["decode"])
    assert node.ledger.quarantined_count() == 0
    assert allocator.available_size() == POOL


def _peer_abort(node: DecodeNode, receiver: Receiver, sent_kv: bool) -> None:
    from sglang_harden.compat import notify, shared
    from sglang_harden.compat.runtime import RUNTIME

    RUNTIME.writer_never_started = node.note_never_started
    receiver.conclude_state = None
    receiver.kv_mgr = SimpleNamespace(record_failure=lambda *a: None, update_status=lambda *a: None)
    shared.fail_receiver_room(receiver, notify.PeerAbort(receiver.bootstrap_room, 400, "too long", sent_kv))


@pytest.mark.parametrize(
    ("sent_kv", "quarantined"),
    [(False, 0), (True, 20)],
    ids=["refused-before-any-sender-released-at-once", "aborted-after-a-chunk-waits-for-the-ack"],
)
def test_peer_abort_releases_only_rooms_never_written(allocator: Any, sent_kv: bool, quarantined: int) -> None:
    """Prefill refused the room before any sender existed: no write can come, decode frees at once. Otherwise
    prefill's word is not a drain: the pages wait in quarantine for the ack."""
    node = DecodeNode.for_allocator(allocator, cap=40)
    lifecycle_v05.NODE = node
    a = allocator.alloc(20)
    receiver = Receiver(ROOM_A)
    _publish(receiver, a)
    _peer_abort(node, receiver, sent_kv=sent_kv)
    allocator.free(a)
    assert node.ledger.quarantined_count() == quarantined
    assert allocator.available_size() == POOL - quarantined


def test_never_started_from_another_prefill_does_not_release(allocator: Any) -> None:
    node = DecodeNode.for_allocator(allocator, cap=40)
    lifecycle_v05.NODE = node
    a = allocator.alloc(10)
    _publish(Receiver(ROOM_A), a)
    node.note_never_started(ROOM_A, "127.0.0.1:9999")  # a different bootstrap server than the writer's
    allocator.free(a)
    assert node.ledger.quarantined_count() == 10


def test_completed_transfer_frees_normally(allocator: Any) -> None:
    node = DecodeNode.for_allocator(allocator, cap=40)
    lifecycle_v05.NODE = node
    a = allocator.alloc(12)
    _publish(Receiver(ROOM_B), a)
    assert node.finish(ROOM_B) is not None
    allocator.free(a)
    assert node.ledger.quarantined_count() == 0
    assert allocator.available_size() == POOL
    assert not node.transfers, "bookkeeping of a finished transfer is dropped"


def _no_numpy_copy(*_: Any) -> None:
    raise AssertionError("the usual free must read the index tensor in place, not make a numpy array of it")


def test_usual_free_reads_the_index_tensor_in_place(allocator: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A finished request's free (its transferred slots and those of the tokens decode generated) is one native
    call over the index tensor's memory."""
    node = DecodeNode.for_allocator(allocator, cap=40)
    lifecycle_v05.NODE = node
    transferred, generated = allocator.alloc(12), allocator.alloc(4)
    _publish(Receiver(ROOM_B), transferred)
    node.finish(ROOM_B)
    monkeypatch.setattr(free_path_v05, "_pages_of", _no_numpy_copy)
    allocator.free(torch.cat((transferred, generated)))
    assert allocator.available_size() == POOL and not node.transfers
    assert not node.ledger.holds_pages(owner_of_room(ROOM_B))
    untracked = allocator.alloc(5)
    allocator.free(untracked)  # none tracked: in place too
    assert allocator.available_size() == POOL


def test_in_place_free_reads_int32_and_leaves_strided_indices_to_the_general_path(allocator: Any) -> None:
    node = DecodeNode.for_allocator(allocator, cap=40)
    lifecycle_v05.NODE = node
    slots = allocator.alloc(6)
    _publish(Receiver(ROOM_A), slots)
    strided = torch.stack((slots, slots), dim=1)[:, 0]
    assert not strided.is_contiguous() and not node.released_in_place(strided)
    assert not node.released_in_place(slots.to(torch.int32)), "still being written: the general path decides"
    assert node.ledger.state(int(slots[0])) is PageState.WRITING
    node.finish(ROOM_A)
    assert node.released_in_place(slots.to(torch.int32))
    assert node.ledger.state(int(slots[0])) is PageState.FREE and not node.transfers
    allocator.free(slots)


def test_log_mode_reports_only_what_enforce_would_quarantine(allocator: Any) -> None:
    saved = RUNTIME.config
    RUNTIME.config = dataclasses.replace(saved, lifecycle=Mode.LOG)
    try:
        node = DecodeNode.for_allocator(allocator, cap=40)
        lifecycle_v05.NODE = node
        before = events.snapshot().get("lifecycle:quarantine_logged", 0)
        done = allocator.alloc(12)
        _publish(Receiver(ROOM_B), done)
        node.finish(ROOM_B)
        allocator.free(done)  # written, no drain ack: enforce frees these, so there is nothing to report
        assert events.snapshot().get("lifecycle:quarantine_logged", 0) == before
        in_flight = allocator.alloc(12)
        _publish(Receiver(ROOM_A), in_flight)
        allocator.free(in_flight)  # still being written: enforce would quarantine it; log mode reports, holds nothing
        assert events.snapshot().get("lifecycle:quarantine_logged", 0) == before + 1
        assert node.ledger.quarantined_count() == 0 and allocator.available_size() == POOL
    finally:
        RUNTIME.config = saved


def test_quarantine_cap_closes_the_decode_door(allocator: Any) -> None:
    node = DecodeNode.for_allocator(allocator, cap=8)
    lifecycle_v05.NODE = node
    a = allocator.alloc(10)
    _publish(Receiver(ROOM_A), a)
    allocator.free(a)
    decision = node.ledger.admission_open(node.cap)
    assert decision.verdict is Verdict.REJECT and decision.status_code == 503
    assert "quarantined" in decision.reason


def _scheduler_with_table(rows: list[int]) -> Any:
    table = torch.zeros((4, 64), dtype=torch.int32)
    table[1, : len(rows)] = torch.tensor(rows, dtype=torch.int32)
    return SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=table))


def _checked_transfer_of_b(allocator: Any) -> tuple[DecodeNode, Any, Any, Any, Any]:
    """B's 16 pages reserved, written and committed; its page table passes the check: (node, pages, transfer,
    request, scheduler)."""
    node = DecodeNode.for_allocator(allocator, cap=40)
    lifecycle_v05.NODE = node
    a = allocator.alloc(16)
    _publish(Receiver(ROOM_B), a)
    transfer = node.finish(ROOM_B)
    assert transfer is not None
    req = SimpleNamespace(rid="req-b", origin_input_ids=list(range(16)), req_pool_idx=1, kv=None,
                          prefix_indices=None, finished_reason=None, return_logprob=False, bootstrap_room=ROOM_B)
    scheduler = _scheduler_with_table(a.tolist())
    assert page_tags_v05.check_request_pages(node, scheduler, req, transfer).verdict is Verdict.ALLOW
    return node, a, transfer, req, scheduler


def test_page_tags_refuse_a_misowned_page(allocator: Any) -> None:
    node, a, transfer, req, scheduler = _checked_transfer_of_b(allocator)
    # test hook: hand one page of B's table to another owner (what a late/foreign write would mean)
    victim = int(a[3])
    node.ledger.release(transfer.owner, [victim], writer_drained=True)
    node.ledger.reserve("room:999", [victim])
    decision = page_tags_v05.check_request_pages(node, scheduler, req, transfer)
    assert decision.verdict is Verdict.ABORT and "room:999" in decision.reason


def test_page_tags_read_the_live_page_table(allocator: Any) -> None:
    """The check reads the page table as it is now: a row rewritten after an earlier check (the numpy view is
    shared with the tensor), and a table object the scheduler replaced, are both seen."""
    node, a, transfer, req, scheduler = _checked_transfer_of_b(allocator)
    foreign = allocator.alloc(1)
    scheduler.req_to_token_pool.req_to_token[1, 5] = int(foreign[0])  # a slot the transfer never wrote
    assert page_tags_v05.check_request_pages(node, scheduler, req, transfer).verdict is Verdict.ABORT
    scheduler.req_to_token_pool.req_to_token = scheduler.req_to_token_pool.req_to_token.clone()
    scheduler.req_to_token_pool.req_to_token[1, 5] = int(a[5])
    assert page_tags_v05.check_request_pages(node, scheduler, req, transfer).verdict is Verdict.ALLOW


def test_commit_gate_fails_a_transfer_whose_page_table_is_misowned(allocator: Any) -> None:
    """The page-tag step of the commit gate: a page table row with a slot the transfer never wrote fails the
    transfer (SGLang's failure path then aborts the request on every TP rank) instead of committing it."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from sglang_harden.compat.commit_gate import wiring
    from sglang_harden.compat.gate import CommitGate

    node = DecodeNode.for_allocator(allocator, cap=40)
    lifecycle_v05.NODE = node
    a = allocator.alloc(8)
    receiver = Receiver(ROOM_B)
    failures: list[tuple[int, str]] = []
    receiver.kv_mgr = SimpleNamespace(record_failure=lambda room, reason: failures.append((room, reason)))
    _publish(receiver, a)
    rows = a.tolist()
    rows[2] = int(allocator.alloc(1)[0])  # a row the transfer never wrote
    req = SimpleNamespace(rid="req-c", origin_input_ids=list(range(8)), req_pool_idx=1, kv=None,
                          prefix_indices=None, finished_reason=None, return_logprob=False, bootstrap_room=ROOM_B,
                          bootstrap_host="127.0.0.1")
    decode_req = SimpleNamespace(req=req, kv_receiver=receiver)
    queue = SimpleNamespace(scheduler=_scheduler_with_table(rows), queue=[decode_req])
    gate = CommitGate(wiring())
    gate.join("page_tags", page_tags_v05.PageTagStep(), "page_tags")
    gate.see_queue(queue)
    assert gate.gate(receiver, KVPoll.Success) == KVPoll.Failed
    assert failures and failures[0][0] == ROOM_B and "page ownership check failed" in failures[0][1]
    rows[2] = int(a[2])
    queue.scheduler = _scheduler_with_table(rows)
    node.ledger.release_bulk(owner_of_room(ROOM_B), np.array(a.tolist()), writer_drained=True)
    receiver2 = Receiver(ROOM_A)
    receiver2.kv_mgr = receiver.kv_mgr
    _publish(receiver2, a)
    req.bootstrap_room = ROOM_A
    decode_req.kv_receiver = receiver2
    gate.see_queue(queue)
    assert gate.gate(receiver2, KVPoll.Success) == KVPoll.Success, "a clean page table passes"


def test_prefill_holds_source_pages_until_settled(sglang_modules: dict[str, Any]) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    alloc = sglang_modules["token"].TokenToKVPoolAllocator(POOL, torch.float16, "cpu", None, True)
    node = PrefillNode.for_allocator(alloc)
    lifecycle_v05.NODE = node
    try:
        src = alloc.alloc(10)
        mgr = SimpleNamespace(request_status={ROOM_A: KVPoll.Failed}, _staging_outstanding={ROOM_A: 1})
        node.hold(mgr, ROOM_A, src.numpy().astype(np.int64))
        alloc.free(src)  # request aborted on prefill while a chunk of its transfer is being written
        assert alloc.available_size() == POOL - 10, "source pages held while the chunk is in flight"
        mgr._staging_outstanding[ROOM_A] = 0
        free_path_v05.free_loose_pages(node, node.settle_pending())
        assert alloc.available_size() == POOL
        assert not node.view("pending")
    finally:
        lifecycle_v05.NODE = None


def test_pages_are_numpy_views() -> None:
    node = DecodeNode.for_allocator(SimpleNamespace(size=16, page_size=1), cap=0)
    node.ledger.reserve("x", [3])
    assert node.states[3] == PageState.RESERVED
    assert np.count_nonzero(node.states) == 1


def test_prefill_withholds_drain_ack_and_sources_after_a_failed_write(sglang_modules: dict[str, Any]) -> None:
    """A write the transport reported failed (timed out) may still land: no drain ack, no source free, until
    the sender's write lifetime passed."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    alloc = sglang_modules["token"].TokenToKVPoolAllocator(POOL, torch.float16, "cpu", None, True)
    node = PrefillNode.for_allocator(alloc)
    node.lifetime_s = 0.3
    lifecycle_v05.NODE = node
    try:
        src = alloc.alloc(6)
        mgr = SimpleNamespace(request_status={ROOM_A: KVPoll.Transferring}, _staging_outstanding={ROOM_A: 1},
                              transfer_infos={ROOM_A: {"sess-1": object()}})
        node.hold(mgr, ROOM_A, src.numpy().astype(np.int64))
        send = mooncake_backend._send_kvcache(lambda *a, **k: -1)  # the engine call timed out
        assert send(mgr, "sess-1", np.arange(6), [], np.arange(6), None) == -1
        mgr._staging_outstanding[ROOM_A] = 0  # the worker moved on
        mgr.request_status[ROOM_A] = KVPoll.Failed
        alloc.free(src)
        assert alloc.available_size() == POOL - 6, "sources held while the failed write may still land"

        acks: list[int] = []
        ack = lifecycle_v05._withhold_ack(lambda self, decode_ip, decode_port, room: acks.append(room))
        ack(mgr, "127.0.0.1", 1, ROOM_A)
        assert acks == [], "drain ack withheld"
        lifecycle_v05._settle_after_inflight(lambda self: None)(None)
        assert acks == []
        import time

        time.sleep(0.35)
        lifecycle_v05._settle_after_inflight(lambda self: None)(None)
        assert acks == [ROOM_A]
        assert alloc.available_size() == POOL
    finally:
        lifecycle_v05.NODE = None


def test_ack_target_survives_sender_clear_until_the_write_drained(sglang_modules: dict[str, Any]) -> None:
    """0.5.19: sender.clear() drops the drain-ack target while a chunk is still being written; we keep it."""
    alloc = sglang_modules["token"].TokenToKVPoolAllocator(POOL, torch.float16, "cpu", None, True)
    node = PrefillNode.for_allocator(alloc)
    lifecycle_v05.NODE = node
    try:
        sent: list[tuple[Any, ...]] = []
        mgr = SimpleNamespace(request_status={}, _staging_outstanding={ROOM_A: 1}, transfer_infos={},
                              _deferred_ack_targets={ROOM_A: ("127.0.0.1", 9)},
                              _send_abort_ack=lambda ip, port, room: sent.append((ip, port, room)))
        sender = SimpleNamespace(bootstrap_room=ROOM_A, kv_mgr=mgr)
        lifecycle_v05._keep_ack_target(lambda self: self.kv_mgr._deferred_ack_targets.pop(ROOM_A))(sender)
        assert mgr._deferred_ack_targets == {}
        lifecycle_v05._settle_after_inflight(lambda self: None)(None)
        assert sent == [], "still being written"
        mgr._staging_outstanding[ROOM_A] = 0
        lifecycle_v05._settle_after_inflight(lambda self: None)(None)
        assert sent == [("127.0.0.1", 9, ROOM_A)]
    finally:
        lifecycle_v05.NODE = None


def test_idle_leak_check_counts_quarantined_pages(allocator: Any) -> None:
    from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker

    node = DecodeNode.for_allocator(allocator, cap=40)
    lifecycle_v05.NODE = node
    a = allocator.alloc(10)
    _publish(Receiver(ROOM_A), a)
    allocator.free(a)
    leak, msg = SchedulerInvariantChecker._check_pool_invariant("full", allocator.available_size(), 0, 0, 0, POOL)
    assert not leak, msg


def _prefill_node_with_short_lifetime(sglang_modules: dict[str, Any]) -> PrefillNode:
    """The prefill node of this process over a real allocator, a failed write living 0.2 s."""
    alloc = sglang_modules["token"].TokenToKVPoolAllocator(POOL, torch.float16, "cpu", None, True)
    node = PrefillNode.for_allocator(alloc)
    node.lifetime_s = 0.2
    lifecycle_v05.NODE = node
    return node


def test_poisoned_room_is_acked_after_the_write_lifetime(sglang_modules: dict[str, Any]) -> None:
    """0.5.23 never acks a room whose engine call failed ("poisoned"); we keep its ack target and ack once the
    sender's write lifetime passed, so decode's quarantine ends without a bare-timeout release."""
    import time

    node = _prefill_node_with_short_lifetime(sglang_modules)
    try:
        sent: list[Any] = []
        mgr = SimpleNamespace(request_status={}, _staging_outstanding={}, transfer_infos={},
                              _send_abort_ack=lambda ip, port, room: sent.append(("tuple", room)),
                              _send_abort_acks=lambda room, targets: sent.append(("dict", room, len(targets))))
        node.note_failed_write([ROOM_A])
        target = SimpleNamespace(ip="127.0.0.1", port=9, generation=3)
        register = lifecycle_v05._capture_ack_target(lambda self, room, target: None)  # upstream refuses it
        register(mgr, ROOM_A, target)
        lifecycle_v05._settle_after_inflight(lambda self: None)(None)
        assert sent == []
        time.sleep(0.25)
        lifecycle_v05._settle_after_inflight(lambda self: None)(None)
        assert sent == [("dict", ROOM_A, 1)]
    finally:
        lifecycle_v05.NODE = None


def test_nixl_backend_hooks_in_place(sglang_modules: dict[str, Any]) -> None:
    """The ledger is fed from NIXL's receiver/manager too (hook targets exist with the expected signature)."""
    from sglang_harden.compat.hooks import is_in_place

    try:
        import sglang.srt.disaggregation.nixl.conn  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"NIXL is not installed in this pin's venv ({exc}); ci/pins.toml lists it for 0.5.23")
    nixl_hooks = list(nixl_backend.HOOKS)
    assert {h.qualname for h in nixl_hooks} == {"NixlKVReceiver.send_metadata", "NixlKVManager.add_transfer_request",
                                                 "NixlKVManager.send_kvcache",
                                                 "NixlKVManager._handle_abort_notification"}
    assert all(is_in_place(h) for h in nixl_hooks)


def test_optional_hooks_follow_the_release(sglang_modules: dict[str, Any]) -> None:
    """Each optional hook is in place exactly where this release has its target (0.5.22+: the poison of an undrained
    room and the PP consensus store, 0.5.19: Mooncake's per-endpoint status sync, 0.5.20+: the retired aborted
    result), and where it has not,
    the start-up check does not count it missing; a required hook never is optional."""
    import importlib

    from sglang_harden.compat import sglang_v05
    from sglang_harden.compat.hooks import PAGE_LEDGER_OWNER, is_in_place, missing, probed_absent

    assert {h.qualname for h in sglang_v05.OPTIONAL_HOOKS} == {
        "CommonKVManager.poison_deferred_ack_room", "MooncakeKVManager.sync_status_to_decode_endpoint",
        "CommonKVManager._make_worker_recv", "prefetch_staging_reqs",
        "SchedulerDisaggregationPrefillMixin._retire_aborted_prefill_result", "RadixCache.cache_unfinished_req",
        "RadixCache.checkpoint", "UnifiedRadixCache.cache_unfinished_req", "UnifiedRadixCache.checkpoint",
        "PPConsensusStore._init_zmq"}
    for hook in sglang_v05.OPTIONAL_HOOKS:
        if hook.owner == PAGE_LEDGER_OWNER:  # the page-tag guard's copies, armed only with the lifecycle guard off
            continue
        if hook.owner == "zmq_auth":  # armed only with a control-plane secret (test_zmq_channels_inprocess.py)
            continue
        module = importlib.import_module(hook.module)
        owner, name = hook.qualname.split(".")
        present = hasattr(getattr(module, owner), name)
        assert is_in_place(hook) == present and probed_absent(hook) == (not present), hook.target
        assert missing([hook]) == []
    required = next(h for h in lifecycle_v05.HOOKS if not h.optional)
    assert not probed_absent(required)


def _concluded_room_manager(status: Any, outstanding: int) -> tuple[Any, list[Any], list[Any]]:
    """A prefill KV manager's state as SGLang's abort-notice handler reads it: room A concluded (``status``; None:
    cleared) with ``outstanding`` chunks still counted; what it registers and acks is recorded."""
    registered: list[Any] = []
    acks: list[Any] = []
    mgr = SimpleNamespace(request_status={} if status is None else {ROOM_A: status},
                          _staging_outstanding={ROOM_A: outstanding}, enable_deferred_decode_kv_release=True,
                          _deferred_ack_targets={}, failure_records={})
    mgr.check_status = lambda room: mgr.request_status[room]
    mgr.record_failure = lambda *a, **k: None
    mgr.update_status = lambda room, status: None
    mgr.register_deferred_ack_target = lambda room, *target: registered.append((room, target))
    mgr._maybe_ack_drained_abort = lambda room: None
    mgr._send_abort_ack = lambda ip, port, room: acks.append((room, ip, port))
    return mgr, registered, acks


ABORT_NOTICE = [b"ABORT", str(ROOM_A).encode(), b"127.0.0.1", b"9999"]


@pytest.mark.parametrize("status", ["success", "cleared"])
def test_abort_notice_for_a_concluded_room_in_flight_is_acked_once_it_settles(sglang_modules: dict[str, Any],
                                                                              status: str) -> None:
    """NIXL: decode's abort notice crosses prefill's Success (or the room's clear). SGLang's handler on these pins
    registers no ack target and sends no ack while a chunk of the room is still counted, so decode's pages
    would stay held for good; the guard keeps the target and acks once the room settled. The real handler runs
    on a stand-in manager (its state is what the handler reads)."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.nixl.conn import NixlKVManager

    if not backends_common.drops_ack_of_concluded_room("nixl"):
        pytest.skip(f"{RUNTIME.pin}: SGLang keeps the target of a concluded room with a chunk in flight itself")
    alloc = sglang_modules["token"].TokenToKVPoolAllocator(POOL, torch.float16, "cpu", None, True)
    lifecycle_v05.NODE = node = PrefillNode.for_allocator(alloc)
    concluded = KVPoll.Success if status == "success" else None
    try:
        vanilla = inspect.unwrap(NixlKVManager._handle_abort_notification)
        mgr, registered, acks = _concluded_room_manager(concluded, outstanding=1)
        assert vanilla(mgr, ABORT_NOTICE) is True
        assert (registered, acks) == ([], []), "SGLang's own handler: no target kept, no ack"
        assert not node.view("kept_target")

        hooked = nixl_backend._nixl_abort_notice(vanilla)
        assert hooked(mgr, ABORT_NOTICE) is True
        assert node.view("kept_target") == {ROOM_A: ("127.0.0.1", 9999)}
        lifecycle_v05._settle_after_inflight(lambda self: None)(None)
        assert acks == [], "no ack while the chunk is still counted"
        mgr._staging_outstanding[ROOM_A] = 0  # the worker finished the chunk
        lifecycle_v05._settle_after_inflight(lambda self: None)(None)
        assert acks == [(ROOM_A, "127.0.0.1", 9999)] and not node.view("kept_target")

        quiet, _, own_acks = _concluded_room_manager(concluded, outstanding=0)
        hooked(quiet, ABORT_NOTICE)
        assert own_acks == [(ROOM_A, "127.0.0.1", 9999)], "nothing in flight: SGLang acks at once itself"
        assert not node.view("kept_target"), "and the guard keeps nothing"
    finally:
        lifecycle_v05.NODE = None


def test_mooncake_abort_notices_are_watched_on_the_listener_socket(sglang_modules: dict[str, Any]) -> None:
    """Mooncake handles abort notices inline in its prefill listener thread on these pins; the guard reads them off
    the listener's socket as the thread receives them (the thread itself runs in the e2e test). A stand-in
    socket and manager here; every other message passes untouched."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    if not backends_common.drops_ack_of_concluded_room("mooncake"):
        pytest.skip(f"{RUNTIME.pin}: SGLang keeps the target of a concluded room with a chunk in flight itself")
    alloc = sglang_modules["token"].TokenToKVPoolAllocator(POOL, torch.float16, "cpu", None, True)
    lifecycle_v05.NODE = node = PrefillNode.for_allocator(alloc)
    try:
        mgr, _, acks = _concluded_room_manager(KVPoll.Success, outstanding=1)
        inbox = [[b"None", b"127.0.0.1", b"1", b"session"], ABORT_NOTICE, [b"ABORT", b"not-a-room", b"x", b"y"]]
        mgr.server_socket = SimpleNamespace(recv_multipart=lambda: inbox.pop(0), closed=False)
        mooncake_backend._mooncake_abort_notices(lambda self: None)(mgr)
        assert isinstance(mgr.server_socket, mooncake_backend._NoticeWatchingSocket) and not mgr.server_socket.closed
        assert mgr.server_socket.recv_multipart()[0] == b"None" and not node.view("kept_target")
        assert mgr.server_socket.recv_multipart() == ABORT_NOTICE
        assert node.view("kept_target") == {ROOM_A: ("127.0.0.1", 9999)}
        mgr.server_socket.recv_multipart()  # a malformed notice: SGLang's to log
        assert list(node.view("kept_target")) == [ROOM_A]
        mgr._staging_outstanding[ROOM_A] = 0
        lifecycle_v05._settle_after_inflight(lambda self: None)(None)
        assert acks == [(ROOM_A, "127.0.0.1", 9999)]
    finally:
        lifecycle_v05.NODE = None


def test_nixl_failed_post_is_a_failed_write(sglang_modules: dict[str, Any]) -> None:
    """A NIXL KV post that raised may have been posted in part: its room is a failed write (no drain ack, sources
    held, for the write lifetime), like a Mooncake engine call that returned -1."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    alloc = sglang_modules["token"].TokenToKVPoolAllocator(POOL, torch.float16, "cpu", None, True)
    node = PrefillNode.for_allocator(alloc)
    node.lifetime_s = 30.0
    lifecycle_v05.NODE = node
    try:
        mgr = SimpleNamespace(request_status={ROOM_A: KVPoll.Transferring, ROOM_B: KVPoll.Transferring},
                              _staging_outstanding={ROOM_A: 1},
                              transfer_infos={ROOM_A: {"agent-d": object()}, ROOM_B: {"agent-d": object()}})

        def post_fails(self: Any, peer_name: str, prefill_kv_indices: Any, *args: Any) -> Any:
            raise RuntimeError("KVSender failed to post prepped transfer")

        send = nixl_backend._nixl_send_kvcache(post_fails)
        with pytest.raises(RuntimeError, match="failed to post"):
            send(mgr, "agent-d", np.arange(4), [], np.arange(4), 0)
        assert set(node.view("failed_at")) == {ROOM_A}, "only the room being written (ROOM_B has no chunk in flight)"
        mgr.request_status[ROOM_A] = KVPoll.Failed
        mgr._staging_outstanding[ROOM_A] = 0
        assert not node.settled(ROOM_A)
        assert nixl_backend._nixl_send_kvcache(lambda *a: "handle")(mgr, "agent-d", np.arange(4)) == "handle"
    finally:
        lifecycle_v05.NODE = None


def test_failure_without_a_write_in_flight_carries_its_drain_ack(sglang_modules: dict[str, Any]) -> None:
    """The transfer worker fails a room it wrote nothing of (its decode session was just marked failed): the
    drain ack goes out first, on the same channel, so decode frees the pages instead of quarantining them. A room
    whose write failed (it may still land) and a success get no ack."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    node = _prefill_node_with_short_lifetime(sglang_modules)
    node.lifetime_s = 30.0

    class Manager:
        enable_staging = False

        def __init__(self) -> None:
            self.sent: list[tuple[Any, ...]] = []

        def _send_abort_ack(self, decode_ip: str, decode_port: int, room: int) -> None:
            self.sent.append(("ack", room))

    def sync_status(self: Manager, remote: str, dst_port: int, room: int, status: int, prefill_rank: int) -> None:
        self.sent.append(("status", room, status))

    try:
        mgr = Manager()
        sync = mooncake_backend._failure_with_drain_evidence(sync_status)
        node.note_failed_write([ROOM_A])
        sync(mgr, "127.0.0.1", 9, ROOM_B, KVPoll.Failed, 0)
        sync(mgr, "127.0.0.1", 9, ROOM_A, KVPoll.Failed, 0)
        sync(mgr, "127.0.0.1", 9, ROOM_B, KVPoll.Success, 0)
        assert mgr.sent == [("ack", ROOM_B), ("status", ROOM_B, KVPoll.Failed), ("status", ROOM_A, KVPoll.Failed),
                            ("status", ROOM_B, KVPoll.Success)]
        Manager.enable_staging = True  # staged writes are not synchronous on the worker: no evidence
        mgr.sent.clear()
        sync(mgr, "127.0.0.1", 9, ROOM_B, KVPoll.Failed, 0)
        assert mgr.sent == [("status", ROOM_B, KVPoll.Failed)]
    finally:
        lifecycle_v05.NODE = None


def test_poison_keeps_the_registered_ack_target(sglang_modules: dict[str, Any]) -> None:
    """0.5.23 drops a poisoned room's ack target (registered before the poison) for good: we keep it and ack
    after the write lifetime, so decode's quarantine ends on the sender's word, never on a bare timeout."""
    import time

    node = _prefill_node_with_short_lifetime(sglang_modules)
    try:
        sent: list[Any] = []
        target = SimpleNamespace(ip="127.0.0.1", port=9, generation=3)
        mgr = SimpleNamespace(request_status={}, _staging_outstanding={}, transfer_infos={},
                              _deferred_ack_targets={ROOM_A: {("127.0.0.1", 9): target}},
                              _deferred_ack_poisoned_rooms=set(),
                              _send_abort_acks=lambda room, targets: sent.append((room, sorted(targets))))

        def upstream_poison(self: Any, room: int) -> None:
            self._deferred_ack_targets.pop(room, None)
            self._deferred_ack_poisoned_rooms.add(room)

        lifecycle_v05._keep_poisoned_target(upstream_poison)(mgr, ROOM_A)
        assert mgr._deferred_ack_targets == {} and ROOM_A in node.view("failed_at")
        lifecycle_v05._settle_after_inflight(lambda self: None)(None)
        assert sent == [], "the write may still land"
        time.sleep(0.25)
        lifecycle_v05._settle_after_inflight(lambda self: None)(None)
        assert sent == [(ROOM_A, [("127.0.0.1", 9)])]
    finally:
        lifecycle_v05.NODE = None


def _door(node: DecodeNode) -> tuple[Any, list[Any], list[Any]]:
    """The quarantine door around a stand-in for ``DecodePreallocQueue.add`` (a real queue needs a running
    scheduler): (the hooked add, requests SGLang's add saw, requests streamed out as aborted)."""
    added: list[Any] = []
    streamed: list[Any] = []
    lifecycle_v05.NODE = node
    add = lifecycle_v05._quarantine_door(lambda queue, req, *a, **k: added.append(req))
    queue = SimpleNamespace(scheduler=SimpleNamespace(
        output_streamer=SimpleNamespace(stream_output=lambda reqs, logprob: streamed.extend(reqs))))
    return (lambda req: add(queue, req)), added, streamed


def _new_request(room: int) -> Any:
    return SimpleNamespace(rid=f"r{room}", bootstrap_room=room, finished_reason=None, return_logprob=False,
                           to_finish=None)


def test_quarantine_door_admits_below_the_cap_and_refuses_at_it(allocator: Any) -> None:
    node = DecodeNode.for_allocator(allocator, cap=8)
    add, added, streamed = _door(node)
    before = events.snapshot().get("lifecycle:allow", 0)
    first = _new_request(ROOM_B)
    add(first)
    assert added == [first] and not streamed
    assert events.snapshot().get("lifecycle:allow", 0) == before + 1, "the admission is counted"

    a = allocator.alloc(10)
    _publish(Receiver(ROOM_A), a)
    allocator.free(a)  # still being written: 10 pages quarantined, over the cap of 8
    assert node.ledger.quarantined_count() == 10
    refused = _new_request(ROOM_B + 1)
    add(refused)
    assert added == [first], "SGLang's queue never sees a request refused at the cap"
    assert streamed == [refused] and refused.finished_reason.status_code == 503
    assert "quarantined" in refused.finished_reason.message


def test_prefill_holds_every_chunk_in_its_own_copy(sglang_modules: dict[str, Any]) -> None:
    """Two chunks of one room pass the hold hook; SGLang reusing its index array afterwards changes nothing, and
    once the room settled both chunks' pages go back to the free list."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    alloc = sglang_modules["token"].TokenToKVPoolAllocator(POOL, torch.float16, "cpu", None, True)
    node = PrefillNode.for_allocator(alloc)
    lifecycle_v05.NODE = node
    try:
        first, second = alloc.alloc(6), alloc.alloc(5)
        mgr = SimpleNamespace(request_status={ROOM_A: KVPoll.Transferring}, transfer_infos={ROOM_A: {}},
                              _staging_outstanding={})
        hold = lifecycle_v05._hold_sources(lambda *a, **k: None)
        for chunk in (first, second):
            indices = chunk.numpy().astype(np.int64)
            hold(mgr, ROOM_A, indices)
            indices[:] = 0  # SGLang's array, reused: the node kept its own copy
        alloc.free(torch.cat((first, second)))  # aborted on prefill mid-transfer
        assert alloc.available_size() == POOL - 11, "both chunks' sources held"
        assert np.count_nonzero(node.held_room) == 11
        mgr.request_status[ROOM_A] = KVPoll.Success
        free_path_v05.free_loose_pages(node, node.settle_pending())
        assert alloc.available_size() == POOL and np.count_nonzero(node.held_room) == 0
        assert not node.view("sources") and not node.view("pending")
    finally:
        lifecycle_v05.NODE = None


@pytest.mark.parametrize("room_b", [ROOM_B, -5], ids=["room", "negative-room"])
def test_prefill_free_lets_go_of_settled_sources_only(sglang_modules: dict[str, Any], room_b: int) -> None:
    """One free over a settled room's sources (the usual case, and its fast path) and over another room's whose
    transfer is still running: only the settled room's pages reach the free list, whatever the rooms' ids."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    alloc = sglang_modules["token"].TokenToKVPoolAllocator(POOL, torch.float16, "cpu", None, True)
    node = PrefillNode.for_allocator(alloc)
    lifecycle_v05.NODE = node
    try:
        a, b = alloc.alloc(6), alloc.alloc(4)
        mgr = SimpleNamespace(request_status={ROOM_A: KVPoll.Success, room_b: KVPoll.Transferring},
                              _staging_outstanding={})
        node.hold(mgr, ROOM_A, a.numpy().astype(np.int64))
        node.hold(mgr, room_b, b.numpy().astype(np.int64))
        alloc.free(torch.cat((a, b)))
        assert alloc.available_size() == POOL - 4, "the running room's sources are held, the settled room's freed"
        assert np.count_nonzero(node.held_room) == 4
        c = alloc.alloc(3)  # a settled room's lone free: the fast path
        node.hold(mgr, ROOM_A + 10, c.numpy().astype(np.int64))
        mgr.request_status[ROOM_A + 10] = KVPoll.Success
        alloc.free(c)
        assert alloc.available_size() == POOL - 4 and np.count_nonzero(node.held_room) == 4
        room_d = room_b * 2  # a running room's sources, freed with a page no room holds
        d, unheld = alloc.alloc(2), alloc.alloc(1)
        node.hold(mgr, room_d, d.numpy().astype(np.int64))
        mgr.request_status[room_d] = KVPoll.Transferring
        alloc.free(torch.cat((d, unheld)))
        assert alloc.available_size() == POOL - 6 and np.count_nonzero(node.held_room) == 6
        mgr.request_status[room_b] = mgr.request_status[room_d] = KVPoll.Success
        free_path_v05.free_loose_pages(node, node.settle_pending())
        assert alloc.available_size() == POOL and np.count_nonzero(node.held_room) == 0
    finally:
        lifecycle_v05.NODE = None


def _pool_with_radix_cache(sglang_modules: dict[str, Any], page_size: int) -> tuple[int, int, Any, Any]:
    """(pool tokens, tokens a test pins, SGLang's allocator for ``page_size``, a real RadixCache over it)."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache

    pool, pinned = (POOL, 20) if page_size == 1 else (4 * page_size, 2 * page_size)
    if page_size == 1:
        alloc = sglang_modules["token"].TokenToKVPoolAllocator(pool, torch.float16, "cpu", None, True)
    else:
        alloc = PagedTokenToKVPoolAllocator(pool, page_size, torch.float16, "cpu", None, True)
    tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
                                      page_size=page_size))
    return pool, pinned, alloc, tree


@pytest.mark.parametrize("page_size", [1, 16], ids=["token", "paged16"])
def test_prefill_budget_leaves_out_cached_pages_a_failed_write_pins(sglang_modules: dict[str, Any],
                                                                     page_size: int) -> None:
    """Found by the soak: a failed write pins its room's source pages for the write lifetime. Once the request
    is done they sit in SGLang's radix cache, which calls them evictable. Prefill admission budgets free +
    evictable tokens, evicts, and allocates that budget. Evicting the pinned pages frees nothing, so the
    allocation failed and SGLang's prefill scheduler died ("Prefill out of memory"). The allocator now leaves
    those tokens out of its count. Real allocator, real RadixCache, SGLang's own evict-then-allocate helper."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.common import evict_from_tree_cache
    from sglang.srt.mem_cache.radix_cache import RadixKey

    pool, pinned, alloc, tree = _pool_with_radix_cache(sglang_modules, page_size)
    node = PrefillNode.for_allocator(alloc)
    node.lifetime_s = 0.5
    lifecycle_v05.NODE = node
    try:
        src = alloc.alloc(pinned)
        pages = (src[::page_size] // page_size).numpy().astype(np.int64)
        mgr = SimpleNamespace(request_status={ROOM_A: KVPoll.Transferring}, _staging_outstanding={ROOM_A: 1},
                              transfer_infos={ROOM_A: {"sess-1": object()}})
        node.hold(mgr, ROOM_A, pages)
        send = mooncake_backend._send_kvcache(lambda *a, **k: -1)  # the engine call failed: the write may land
        assert send(mgr, "sess-1", pages, [], pages, None) == -1
        mgr._staging_outstanding[ROOM_A] = 0
        mgr.request_status[ROOM_A] = KVPoll.Failed
        tree.insert(InsertParams(key=RadixKey(list(range(pinned))), value=src))  # the finished prompt, cached

        vanilla_count = type(alloc).available_size.__wrapped__(alloc)
        assert vanilla_count + tree.evictable_size() == pool, "what an unguarded budget promises"
        budget = alloc.available_size() + tree.evictable_size()
        assert budget == pool - pinned
        leak, msg = SchedulerInvariantChecker._check_pool_invariant("full", alloc.available_size(),
                                                                    tree.evictable_size(), 0, 0, pool)
        assert not leak, msg

        evict_from_tree_cache(tree, budget)
        assert alloc.alloc(pool) is None, "the unguarded promise cannot be kept: the pinned pages did not come back"
        taken = alloc.alloc(budget)
        assert taken is not None and len(taken) == budget, "the guarded budget is what allocation delivers"
        alloc.free(taken)

        import time

        time.sleep(0.55)  # the write lifetime passed: the pinned pages may go back
        lifecycle_v05._settle_after_inflight(lambda self: None)(None)
        assert node.stuck_tokens() == 0 and not node.view("failed_at")
        assert alloc.available_size() == pool
    finally:
        lifecycle_v05.NODE = None


@pytest.mark.parametrize("page_size", [1, 16], ids=["token", "paged16"])
def test_prefill_budget_leaves_out_cached_pages_an_aborted_room_is_still_read_from(sglang_modules: dict[str, Any],
                                                                                   page_size: int) -> None:
    """Found by the 0.5.23/NIXL soak (a prefill died of "Prefill out of memory"): a request aborted while the
    transfer worker still reads a chunk of it (0.5.23's per-room count of chunks in flight) lets go of its pages;
    the ones shared as a cached prefix stay in SGLang's radix cache as evictable, but the guard keeps them back
    from the free list until the read ends, so evicting them frees nothing. Here every other page is taken, so
    more is pinned than is free: the budget (free + evictable) must come out at zero, not at the pinned pages.
    Real allocator, real RadixCache, SGLang's own evict-then-allocate helper."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.common import evict_from_tree_cache
    from sglang.srt.mem_cache.radix_cache import RadixKey

    pool, pinned, alloc, tree = _pool_with_radix_cache(sglang_modules, page_size)
    node = PrefillNode.for_allocator(alloc)
    lifecycle_v05.NODE = node
    try:
        src = alloc.alloc(pinned)
        mgr = SimpleNamespace(request_status={ROOM_A: KVPoll.Transferring}, _staging_outstanding={ROOM_A: 1},
                              transfer_infos={ROOM_A: {"peer": object()}})
        node.hold(mgr, ROOM_A, (src[::page_size] // page_size).numpy().astype(np.int64))
        tree.insert(InsertParams(key=RadixKey(list(range(pinned))), value=src))  # the cached prefix
        others = alloc.alloc(pool - pinned)  # a live request holds the rest of the pool
        assert others is not None
        assert alloc.available_size() + tree.evictable_size() == pinned, "a live read: nothing to leave out yet"
        mgr.request_status[ROOM_A] = KVPoll.Failed  # aborted; its chunk is still being read

        vanilla_count = type(alloc).available_size.__wrapped__(alloc)
        assert vanilla_count + tree.evictable_size() == pinned, "what an unguarded budget promises"
        budget = alloc.available_size() + tree.evictable_size()
        assert budget == 0, "more pinned than free: the sum must still come out right"
        evict_from_tree_cache(tree, pinned)
        assert alloc.alloc(page_size) is None, "the unguarded promise cannot be kept: eviction freed nothing"

        mgr._staging_outstanding[ROOM_A] = 0  # the worker's read ended
        lifecycle_v05._settle_after_inflight(lambda self: None)(None)
        alloc.free(others)
        assert node.stuck_tokens() == 0 and not node.view("pending")
        assert alloc.available_size() == pool
    finally:
        lifecycle_v05.NODE = None


class _Board:
    """Stands in for the prefill publisher: what it was asked to post."""

    def __init__(self) -> None:
        self.posted: list[Any] = []

    def publish(self, abort: Any) -> None:
        self.posted.append(abort)


@pytest.mark.parametrize("queued", [False, True], ids=["never-queued", "chunk-queued"])
def test_bootstrap_failure_is_published_for_decode(sglang_modules: dict[str, Any], queued: bool) -> None:
    """Found by the soak: a client that hangs up while prefill's handshake runs fails the request there
    (``handle_bootstrap_failure``), and decode waited its own timeout, then SGLang's 30 s deferred release, for
    pages of a request nobody wanted. Prefill now posts the failure; "no KV sent" only when its lifecycle node saw
    no chunk of the room handed to the engine (checked before SGLang frees the request)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    from sglang_harden.compat import sglang_v05

    alloc = sglang_modules["token"].TokenToKVPoolAllocator(POOL, torch.float16, "cpu", None, True)
    node = PrefillNode.for_allocator(alloc)
    lifecycle_v05.NODE = node
    board, saved = _Board(), RUNTIME.publisher
    RUNTIME.publisher = board  # type: ignore[assignment]
    try:
        src = alloc.alloc(4)
        if queued:
            mgr = SimpleNamespace(request_status={ROOM_A: KVPoll.Transferring}, _staging_outstanding={ROOM_A: 1})
            node.hold(mgr, ROOM_A, src.numpy().astype(np.int64))
        req = SimpleNamespace(rid="soak-d-1", bootstrap_room=ROOM_A, finished_reason=None)

        def sglang_handles_it(self: Any, req: Any) -> None:
            node._settle(ROOM_A)  # SGLang frees the request's pages: the node lets go of the room
            req.finished_reason = SimpleNamespace(message="Aborted by AbortReq.")

        sglang_v05._publish_bootstrap_failure(sglang_handles_it)(SimpleNamespace(tp_size=1), req)
        assert [(a.room, a.sent_kv) for a in board.posted] == [(ROOM_A, queued)]
        assert "AbortReq" in board.posted[0].message
    finally:
        RUNTIME.publisher = saved
        lifecycle_v05.NODE = None


@pytest.mark.parametrize("sent_kv,released", [(False, True), (True, False), (None, False)],
                         ids=["never-written", "kv-may-have-gone", "no-notice"])
def test_deferred_release_ends_on_a_never_written_notice(sglang_modules: dict[str, Any], sent_kv: bool | None,
                                                         released: bool) -> None:
    """SGLang's own ``CommonKVManager.is_abort_release_safe`` (hooked): with no drain ack it holds the pages;
    prefill's "never queued a write" notice for the room releases them, anything else keeps waiting."""
    from sglang_harden.compat import notify

    conn = sglang_modules["conn"]
    params = inspect.signature(conn.CommonKVManager.note_abort_ack).parameters
    tracker: dict[int, Any] = {}
    if "generation" in params:  # 0.5.23 keeps a per-room state object
        tracker[ROOM_A] = SimpleNamespace(generation=1, prefill_ranks=set())
    else:
        tracker[ROOM_A] = set()
    mgr = SimpleNamespace(_deferred_abort_ack_tracker=tracker)
    watcher = notify.DecodeWatcher(lambda receiver, abort: None)
    if sent_kv is not None:
        watcher._hits[ROOM_A] = notify.PeerAbort(ROOM_A, 500, "Aborted by AbortReq.", sent_kv)
    saved = RUNTIME.watcher
    RUNTIME.watcher = watcher
    try:
        assert conn.CommonKVManager.is_abort_release_safe(mgr, ROOM_A, 1) is released
    finally:
        RUNTIME.watcher = saved
