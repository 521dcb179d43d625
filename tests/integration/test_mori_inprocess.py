"""The page lifecycle on MORI, driven through the pin's real ``mori/conn.py``: run under a pin venv.

MORI cannot run here: it needs RDMA NICs and ROCm. Its ``conn.py`` imports two names from the ``mori`` package
(``mori.cpp.TransferStatus`` and a few ``mori.io`` engine types); a stand-in package provides them, and the tests
call the real ``MoriKVManager``/``MoriKVReceiver`` methods on objects built without ``__init__`` (which would
open the RDMA engine). What stands in: the engine's statuses (``Status``), the sockets (an ack is recorded where
SGLang would send it), the transfer queue. What is real: MORI's worker and drainer steps, its abort-notice
handling and drain-ack arming, SGLang's common KV manager, the allocator, and our hooks installed by
``activate()``.

Asserted on a release with MORI's drain ack (0.5.22+):
- prefill holds a chunk's source pages until the chunk drained;
- a write whose status ended Failed (the bytes may still land) holds its drain ack and its source pages for the
  write lifetime, on the drainer and on the worker; a failed submission too; an abort notice arriving after the
  failure is still answered, after the lifetime. Vanilla 0.5.22 acks such a room at once, 0.5.23 never;
- decode's receiver feeds the page ledger: pages freed while MORI may still write them stay quarantined.
On an older release (no drain ack on MORI) importing MORI with the lifecycle guard armed refuses, naming the hook.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

from sglang_harden.compat import activate, lifecycle_v05  # noqa: E402
from sglang_harden.compat.backends import mori as mori_backend  # noqa: E402
from sglang_harden.compat.hooks import HookInstallError, is_in_place  # noqa: E402
from sglang_harden.compat.lifecycle_nodes import DecodeNode  # noqa: E402
from sglang_harden.compat.prefill_node import PrefillNode  # noqa: E402
from sglang_harden.guards.lifecycle import PageState  # noqa: E402

POOL = 48
ROOM = 9001
LIFETIME_S = 0.3
DECODE_IP, DECODE_PORT = "127.0.0.1", 9


class Status:
    """Stands in for ``mori.cpp.TransferStatus``: one posted RDMA write, in progress until it ends."""

    def __init__(self, ends: str = "success", in_progress: bool = False) -> None:
        self.ends, self.in_progress = ends, in_progress

    def InProgress(self) -> bool:  # noqa: N802 - MORI's method names
        return self.in_progress

    def Wait(self) -> None:  # noqa: N802
        self.in_progress = False

    def Failed(self) -> bool:  # noqa: N802
        return not self.in_progress and self.ends == "failed"

    def Message(self) -> str:  # noqa: N802
        return "remote access error"


class StatusCode:
    SUCCESS, IN_PROGRESS, FAILED = 0, 1, 2


def _install_mori_stand_in() -> None:
    if "mori" in sys.modules:
        return
    package, cpp, io = ModuleType("mori"), ModuleType("mori.cpp"), ModuleType("mori.io")
    cpp.TransferStatus = Status  # type: ignore[attr-defined]
    for name in ("BackendType", "EngineDesc", "IOEngine", "IOEngineConfig", "MemoryDesc", "MemoryLocationType",
                 "PollCqMode", "RdmaBackendConfig"):
        setattr(io, name, type(name, (), {}))
    io.StatusCode = StatusCode  # type: ignore[attr-defined]
    package.cpp, package.io = cpp, io  # type: ignore[attr-defined]
    sys.modules.update({"mori": package, "mori.cpp": cpp, "mori.io": io})


def _mori_drains() -> bool:
    """Whether this release's MORI acknowledges drains (read from its source, without importing it)."""
    import sglang

    from sglang_harden.compat.internals import source_file

    tree = Path(sglang.__file__).parent.parent  # the package __init__ of mori/ imports conn.py: read it instead
    return "supports_deferred_decode_kv_release = True" in (tree / source_file(mori_backend.MODULE)).read_text()


@pytest.fixture(scope="module")
def conn() -> Any:
    activate("integration-test")
    _install_mori_stand_in()
    if not _mori_drains():
        pytest.skip("this release's MORI sends no drain acks: see test_older_mori_refuses_with_the_hook_named")
    from sglang.srt.disaggregation.mori import conn as mori_conn

    return mori_conn


@pytest.fixture()
def allocator() -> Any:
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    yield TokenToKVPoolAllocator(POOL, torch.float16, "cpu", None, True)
    lifecycle_v05.NODE = None


def test_older_mori_refuses_with_the_hook_named() -> None:
    activate("integration-test")
    _install_mori_stand_in()
    if _mori_drains():
        pytest.skip("this release's MORI acknowledges drains: the adapter installs (the tests below)")
    with pytest.raises(HookInstallError, match=r"MoriKVManager\..*--harden-lifecycle off"):
        import sglang.srt.disaggregation.mori.conn  # noqa: F401
    assert "sglang.srt.disaggregation.mori.conn" not in sys.modules, "no unhooked MORI left to run"


def test_mori_hooks_in_place(conn: Any) -> None:
    assert all(is_in_place(hook) for hook in mori_backend.HOOKS)


def test_a_threads_peer_sockets_are_capped(conn: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """MORI keeps a socket per peer endpoint in each thread (an abort notice names any endpoint it likes): SGLang's
    own ``_connect_threadsafe`` keeps every one; with the side_channels hook the thread's oldest are closed past the
    cap (here 3; 1,024 in service). Loopback ports nobody listens on: connecting sends nothing."""
    import inspect

    import zmq

    from sglang_harden.compat import zmq_channels

    monkeypatch.setattr(zmq_channels, "MAX_PEER_SOCKETS", 3)
    hooked = conn.MoriKVManager._connect_threadsafe
    kept = {}
    for name, connect in (("vanilla", inspect.unwrap(hooked)), ("hardened", hooked)):
        manager = conn.MoriKVManager.__new__(conn.MoriKVManager)
        manager._zmq_ctx, manager._socket_local = zmq.Context(), threading.local()
        try:
            for port in range(1, 9):
                connect(manager, f"tcp://127.0.0.1:{port}")
            cache = manager._socket_local.socket_cache
            kept[name] = sorted(cache)
        finally:
            for sock in cache.values():
                sock.close(linger=0)
            manager._zmq_ctx.term()
    assert len(kept["vanilla"]) == 8, kept
    assert kept["hardened"] == [f"tcp://127.0.0.1:{port}" for port in (6, 7, 8)], kept


# ---------------------------------------------------------------- prefill


def _prefill(allocator: Any) -> PrefillNode:
    node = PrefillNode.for_allocator(allocator)
    node.lifetime_s = LIFETIME_S
    lifecycle_v05.NODE = node
    return node


def _manager(conn: Any) -> Any:
    """A prefill ``MoriKVManager`` with room ``ROOM`` bootstrapped and decode's destination known; acks and
    status messages to decode are recorded, not sent."""
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.utils import DisaggregationMode

    mgr = object.__new__(conn.MoriKVManager)
    mgr.__dict__.update(
        disaggregation_mode=DisaggregationMode.PREFILL, enable_deferred_decode_kv_release=True,
        _abort_ack_lock=threading.Lock(), transfer_lock=threading.Lock(), failure_lock=threading.Lock(),
        _staging_outstanding=defaultdict(int), _deferred_ack_targets={}, _deferred_ack_poisoned_rooms=set(),
        request_status={ROOM: KVPoll.Transferring}, transfer_infos={ROOM: {"decode-0": object()}},
        failure_records={}, _num_shards=1, _transfer_queues=[_Queue()], _drain_queue=_Queue(),
        _wait_poll_ms=1, _transfer_timeout_ms=0, engine=SimpleNamespace(wait_all=_wait_all),
        _submission_local=conn._SubmissionLocal(), acks=[], concluded=[])
    mgr._send_multipart_locked = lambda endpoint, frames, is_ipv6=False: mgr.acks.append(frames)
    mgr._prefill_unique_rank = lambda: 0
    mgr.conclude_transfer = lambda **kw: _conclude(mgr, **kw)
    return mgr


def _conclude(mgr: Any, *, bootstrap_room: int, status: Any, **kwargs: Any) -> None:
    """SGLang's conclusion of a room, less the message to decode."""
    mgr.request_status[bootstrap_room] = status
    mgr.concluded.append((bootstrap_room, status))


class _Queue(list):
    def put(self, item: Any) -> None:
        self.append(item)


def _wait_all(statuses: list[Status], timeout_ms: int) -> int:
    if any(s.in_progress for s in statuses):
        return StatusCode.IN_PROGRESS
    return StatusCode.FAILED if any(s.Failed() for s in statuses) else StatusCode.SUCCESS


def _queue_chunk(mgr: Any, allocator: Any, pages: int = 8) -> tuple[Any, Any]:
    """Prefill hands a chunk of ``pages`` source pages to MORI and a shard worker picks it up."""
    src = allocator.alloc(pages)
    mgr.add_transfer_request(ROOM, src.numpy().astype(np.int32), slice(0, pages), False)
    chunk = mgr._transfer_queues[0].pop()
    mgr._mark_transfer_started(chunk)
    return src, chunk


def _decode_aborts(conn: Any, mgr: Any) -> None:
    notice = conn.AbortNotification(room=ROOM, decode_ip=DECODE_IP, decode_port=DECODE_PORT, generation=1)
    mgr._handle_abort_message(notice.to_zmq())


def _settle_step() -> None:
    """Prefill's scheduler step that releases settled rooms and sends the acks they waited for."""
    lifecycle_v05._settle_after_inflight(lambda self: None)(None)


def _ack_rooms(mgr: Any) -> list[int]:
    return [int(frames[1].decode("ascii")) for frames in mgr.acks]


def _acked_only_after_the_write_lifetime(mgr: Any, allocator: Any, held_pages: int) -> None:
    """No drain ack and the source pages held while the failed write may land; the ack and the pages after."""
    _settle_step()
    assert mgr.acks == [], "the failed write may still land: no drain ack yet"
    assert allocator.available_size() == POOL - held_pages, "its source pages stay held"
    time.sleep(LIFETIME_S + 0.05)
    _settle_step()
    assert set(_ack_rooms(mgr)) == {ROOM}, "acked once the write can no longer land"
    assert allocator.available_size() == POOL


def test_sources_held_until_the_chunk_drained(conn: Any, allocator: Any) -> None:
    _prefill(allocator)
    mgr = _manager(conn)
    src, chunk = _queue_chunk(mgr, allocator)
    _decode_aborts(conn, mgr)
    allocator.free(src)  # prefill lets go of the request while MORI still reads its pages
    assert allocator.available_size() == POOL - 8, "held while the chunk is in flight"
    assert mgr.acks == [], "no drain ack while a write is in flight"
    mgr._drain_transfer_statuses(chunk, [Status("success", in_progress=True)])
    assert _ack_rooms(mgr) == [ROOM]
    _settle_step()
    assert allocator.available_size() == POOL


@pytest.mark.parametrize("where", ["drainer", "worker"])
def test_failed_write_holds_ack_and_sources_for_its_lifetime(conn: Any, allocator: Any, where: str) -> None:
    node = _prefill(allocator)
    mgr = _manager(conn)
    src, chunk = _queue_chunk(mgr, allocator)
    statuses = [Status("success"), Status("failed", in_progress=True)]
    if where == "drainer":  # decode aborted while the write was in flight; the drainer waits it out
        _decode_aborts(conn, mgr)
        allocator.free(src)
        mgr._drain_transfer_statuses(chunk, statuses)
    else:  # the worker's own wait sees the write fail; decode, told so, aborts and asks for the drain ack
        mgr._submit_kv_transfer = lambda *a, **k: statuses
        statuses[1].Wait()
        if mgr._process_transfer_chunk(chunk):
            mgr._mark_transfer_quiescent(chunk)
        assert mgr.concluded == [(ROOM, conn.KVPoll.Failed)]
        _decode_aborts(conn, mgr)
        allocator.free(src)
    assert ROOM in node.view("failed_at")
    _acked_only_after_the_write_lifetime(mgr, allocator, held_pages=8)


def test_failed_submission_is_a_failed_write(conn: Any, allocator: Any) -> None:
    node = _prefill(allocator)
    mgr = _manager(conn)
    src, chunk = _queue_chunk(mgr, allocator)
    _decode_aborts(conn, mgr)
    allocator.free(src)
    mgr._handle_submission_failure(chunk, conn._MoriTransferSubmissionError("post failed", []))
    assert ROOM in node.view("failed_at"), "a submission that raised may have posted part of the chunk"
    _acked_only_after_the_write_lifetime(mgr, allocator, held_pages=8)


def test_abort_notice_after_a_failed_write_is_answered_after_its_lifetime(conn: Any, allocator: Any) -> None:
    """The write failed before decode's abort notice arrived: 0.5.23 has poisoned the room and drops the notice's
    ack target (decode would wait for its own timeout); 0.5.22 would ack at once. Either way: one ack, late."""
    _prefill(allocator)
    mgr = _manager(conn)
    src, chunk = _queue_chunk(mgr, allocator)
    mgr._drain_transfer_statuses(chunk, [Status("failed")])
    _decode_aborts(conn, mgr)
    allocator.free(src)
    _acked_only_after_the_write_lifetime(mgr, allocator, held_pages=8)


def test_vanilla_mori_acks_or_drops_a_failed_write(conn: Any, allocator: Any) -> None:
    """Without the lifecycle guard (no node): the source pages go straight back to the free list, and the failed
    write's drain ack goes out at once (0.5.22: decode frees pages the write may still land on) or never (0.5.23:
    decode keeps them until its own timeout, then frees them on that bare timeout)."""
    lifecycle_v05.NODE = None
    mgr = _manager(conn)
    src, chunk = _queue_chunk(mgr, allocator)
    _decode_aborts(conn, mgr)
    allocator.free(src)
    assert allocator.available_size() == POOL, "sources reusable while MORI still reads them"
    mgr._drain_transfer_statuses(chunk, [Status("failed", in_progress=True)])
    poisons = hasattr(conn.MoriKVManager, "_poison_failed_transfer")
    assert _ack_rooms(mgr) == ([] if poisons else [ROOM])


# ---------------------------------------------------------------- decode


def _receiver(conn: Any) -> Any:
    """A decode ``MoriKVReceiver`` whose bootstrap is done; what it sends to prefill is recorded, not sent."""
    receiver = object.__new__(conn.MoriKVReceiver)
    sent: list[Any] = []
    sock = SimpleNamespace(send_multipart=sent.append)
    receiver.__dict__.update(
        bootstrap_room=ROOM, bootstrap_addr="127.0.0.1:8998", required_dst_info_num=1, conclude_state=None,
        abort_notified=False,
        bootstrap_infos=[{"rank_ip": "127.0.0.1", "rank_port": 1, "is_dummy": False}], sent=sent, aborts=[],
        kv_mgr=SimpleNamespace(enable_staging=False, _staging_ctx=None, local_ip="127.0.0.1", rank_port=2,
                               engine_desc=SimpleNamespace(key="decode-engine"),
                               build_receiver_metadata_message=lambda **kw: [b"meta"],
                               record_failure=lambda *a: None, update_status=lambda *a: None),
        _connect_to_bootstrap_server=lambda info: (sock, threading.Lock()),
        _send_bootstrap_message=lambda bootstrap_info, message, operation: sent.append(message) or True)
    receiver._send_abort_notification = lambda *a, **k: receiver.aborts.append(ROOM)
    return receiver


def test_decode_quarantines_pages_mori_may_still_write(conn: Any, allocator: Any) -> None:
    node = DecodeNode.for_allocator(allocator, cap=40)
    lifecycle_v05.NODE = node
    pages = allocator.alloc(16)
    receiver = _receiver(conn)
    receiver.send_metadata(pages.numpy().astype(np.int32))
    assert receiver.sent, "SGLang's own send_metadata ran"
    assert node.ledger.state(int(pages[0])) == PageState.WRITING
    allocator.free(pages)  # decode gives up on the request while prefill's write may be in flight
    assert node.ledger.quarantined_count() == 16
    assert allocator.available_size() == POOL - 16, "not handed to the next request"
    assert receiver.aborts == [ROOM], "decode asks prefill for the drain ack"
