"""The page-lifecycle patch of the 0.4.x and 0.5.10.post1 series: its own abort notice (decode -> every prefill
rank) and drain acknowledgement (prefill rank -> decode), which those releases lack, on stand-ins for their Mooncake
manager and receiver (a real manager needs a transfer engine: the real pairs are
``tests/e2e/test_patched_lifecycle_e2e.py --pins 0.4.9.post6,0.4.10.post2,0.5.10.post1``). The acknowledgement goes
over a real ZMQ socket on loopback. Needs torch (the
module's decode half filters index tensors): run with a pin's venv python, as ``scripts/run_tests.sh`` does.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from test_patch import patched_trees
from test_patched_lifecycle import Allocator, load

from sglang_harden.compat.internals import SIDE_CHANNELS_BACKPORT

torch = pytest.importorskip("torch")
zmq = pytest.importorskip("zmq")

FAILED, WAITING = 0, 2  # KVPoll.Failed, KVPoll.WaitingForInput


PINS = ("0.4.9.post6", "0.5.10.post1")
# where each release's idle memory check lives (the patch counts quarantined pages as held there)
MEMORY_CHECK = {"0.4.9.post6": "sglang/srt/managers/scheduler.py",
                "0.5.10.post1": "sglang/srt/managers/scheduler_runtime_checker_mixin.py"}


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return patched_trees(tmp_path_factory, PINS)


@pytest.fixture(params=PINS)
def tree(request: pytest.FixtureRequest, trees: dict[str, Path]) -> Path:
    return trees[str(request.param)]


class Manager:
    """0.4.9's prefill MooncakeKVManager as the module uses it: room statuses, failures, transfer infos, its rank."""

    def __init__(self) -> None:
        self.request_status: dict[int, int] = {}
        self.failures: dict[int, str] = {}
        self.transfer_infos: dict[int, dict[str, Any]] = {}
        self.kv_args = SimpleNamespace(engine_rank=1)

    def record_failure(self, room: int, reason: str) -> None:
        self.failures[room] = reason

    def update_status(self, room: int, status: int) -> None:
        self.request_status[room] = status


def _stub_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SGLang names the prefill half imports (KVPoll; the side-channel patch's ``sign_socket`` on its ack socket,
    which with no secret, as here, signs nothing), for a test without 0.4.x installed."""
    def module(name: str) -> ModuleType:
        if name not in sys.modules or not isinstance(sys.modules[name], ModuleType):
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        return sys.modules[name]

    for name in ("sglang", "sglang.srt", "sglang.srt.disaggregation", "sglang.srt.disaggregation.common"):
        module(name)
    monkeypatch.setattr(module("sglang.srt.disaggregation.base"), "KVPoll",
                        SimpleNamespace(Failed=FAILED), raising=False)
    side = types.ModuleType(SIDE_CHANNELS_BACKPORT)
    side.sign_socket = lambda sock, endpoint: None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, SIDE_CHANNELS_BACKPORT, side)


@pytest.fixture
def decode_socket() -> Any:
    """Decode's side of the acknowledgement: a PULL socket on a loopback port."""
    sock = zmq.Context.instance().socket(zmq.PULL)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    sock.setsockopt(zmq.RCVTIMEO, 2000)
    yield sock, port
    sock.close(linger=0)


def two_prefill_ranks(tree: Path) -> dict[str, Any]:
    """A decode receiver's fields that say its transfer targets prefill ranks 0 and 1: 0.4.x's Mooncake receiver
    (TP ranks within the prefill DP group ``target_dp_group``) or 0.5.10's common one (TP/PP/CP ranks and
    ``prefill_info``)."""
    if tree.name.startswith("0.4."):
        return {"target_tp_ranks": [0, 1], "target_dp_group": 0, "prefill_tp_size": 2, "prefill_dp_size": 1}
    return {"target_tp_ranks": [0, 1], "target_pp_ranks": [0], "target_cp_ranks": [0],
            "prefill_info": SimpleNamespace(pp_size=1, attn_cp_size=1)}


def _notice(room: int, port: int) -> list[bytes]:
    return [b"SGH_ABORT", str(room).encode(), b"127.0.0.1", str(port).encode()]


def _prefill(tree: Path, monkeypatch: pytest.MonkeyPatch, **settings: str) -> tuple[Any, Manager]:
    """The series' lifecycle module loaded with ``settings``, SGLang stubbed, and a prefill manager."""
    lifecycle = load(tree, monkeypatch, **settings)
    _stub_sglang(monkeypatch)
    return lifecycle, Manager()


def test_an_abort_is_acknowledged_only_once_the_rooms_chunk_is_done(
        tree: Path, monkeypatch: pytest.MonkeyPatch, decode_socket: Any) -> None:
    lifecycle, manager = _prefill(tree, monkeypatch)
    sock, port = decode_socket
    manager.request_status[41] = WAITING
    assert lifecycle.chunk_starts(manager, 41) is False  # the worker holds a chunk of room 41
    assert lifecycle.abort_notice_received(manager, _notice(41, port)) is True
    assert manager.request_status[41] == FAILED and "aborted by decode" in manager.failures[41]
    with pytest.raises(zmq.Again):
        sock.recv_multipart()  # a chunk is in flight: no acknowledgement yet
    lifecycle.chunk_done(manager, 41)
    assert sock.recv_multipart() == [b"SGH_ABORT_ACK", b"41", b"1"]
    manager.transfer_infos[41] = {"session": "s"}
    assert lifecycle.chunk_starts(manager, 41) is True  # a later chunk of the room is dropped
    assert 41 not in manager.transfer_infos
    lifecycle.chunk_done(manager, 41)
    with pytest.raises(zmq.Again):
        sock.recv_multipart()  # acknowledged once


def test_a_room_prefill_never_saw_is_acknowledged_at_once_and_never_written(
        tree: Path, monkeypatch: pytest.MonkeyPatch, decode_socket: Any) -> None:
    lifecycle, manager = _prefill(tree, monkeypatch)
    sock, port = decode_socket
    assert lifecycle.abort_notice_received(manager, _notice(42, port)) is True
    assert 42 not in manager.request_status  # no status made up for a room this rank does not know
    assert sock.recv_multipart() == [b"SGH_ABORT_ACK", b"42", b"1"]
    manager.request_status[42] = WAITING  # the request reaches prefill after all ...
    assert lifecycle.chunk_starts(manager, 42) is True  # ... and its KV is never sent
    assert manager.request_status[42] == FAILED


def test_a_failed_write_holds_the_ack_and_off_mode_only_consumes_the_notice(
        tree: Path, monkeypatch: pytest.MonkeyPatch, decode_socket: Any) -> None:
    lifecycle, manager = _prefill(tree, monkeypatch, lifetime="0")
    sock, port = decode_socket
    lifecycle.note_failed_write(43)
    assert lifecycle.abort_notice_received(manager, _notice(43, port)) is True
    with pytest.raises(zmq.Again):
        sock.recv_multipart()  # lifetime 0: a failed write is never taken as settled by itself
    off = load(tree, monkeypatch, mode="off")
    assert off.abort_notice_received(manager, _notice(44, port)) is True
    assert off.chunk_starts(manager, 44) is False
    with pytest.raises(zmq.Again):
        sock.recv_multipart()
    assert off.abort_notice_received(manager, [b"44", b"127.0.0.1", b"1", b"session"]) is False  # upstream's own


def test_decode_notifies_every_prefill_rank_and_an_ack_per_rank_releases_the_pages(
        tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lifecycle = load(tree, monkeypatch)
    sent: list[tuple[str, list[bytes]]] = []

    class Lock:
        def __enter__(self) -> None: ...
        def __exit__(self, *exc: object) -> None: ...

    def connect(info: dict[str, Any]) -> Any:
        return SimpleNamespace(send_multipart=lambda frames: sent.append((info["rank_ip"], frames))), Lock()

    rec = SimpleNamespace(bootstrap_room=45, bootstrap_addr="127.0.0.1:8998", abort_notified=False,
                          bootstrap_infos=[{"rank_ip": "10.0.0.1"}, {"rank_ip": "10.0.0.2"}],
                          kv_mgr=SimpleNamespace(local_ip="127.0.0.9", rank_port=7000),
                          _connect_to_bootstrap_server=connect, **two_prefill_ranks(tree))
    rec._send_abort_notification = lambda: lifecycle.send_abort_notice_frames(rec)
    alloc = Allocator()
    lifecycle.note_published(alloc, rec, [5, 6])
    lifecycle.pages_to_free(alloc, torch.tensor([5, 6]))  # the aborted request's pages: quarantined
    assert [ip for ip, _ in sent] == ["10.0.0.1", "10.0.0.2"]
    assert sent[0][1] == [b"SGH_ABORT", b"45", b"127.0.0.9", b"7000"]
    assert lifecycle.ack_frames_received([b"SGH_ABORT_ACK", b"45", b"0"]) is True
    lifecycle.release_drained()
    assert alloc.freed == []  # one of two prefill ranks acknowledged
    assert lifecycle.ack_frames_received([b"45", b"4", b"1"]) is False  # upstream's status message
    lifecycle.ack_frames_received([b"SGH_ABORT_ACK", b"45", b"1"])
    lifecycle.release_drained()
    assert sorted(alloc.freed) == [5, 6]


def test_the_series_counts_a_chunk_before_it_looks_and_hooks_both_sockets(tree: Path) -> None:
    conn = (tree / "sglang/srt/disaggregation/mooncake/conn.py").read_text()
    get = conn.index("kv_chunk: TransferKVChunk = queue.get()")
    assert conn.index("pd_lifecycle.chunk_starts(self, kv_chunk.room)", get) < conn.index("reqs_to_be_processed", get)
    assert conn.count("pd_lifecycle.chunk_done(self, kv_chunk.room)") == 2
    assert "pd_lifecycle.abort_notice_received(self, waiting_req_bytes)" in conn
    assert "pd_lifecycle.ack_frames_received(" in conn
    assert "pd_lifecycle.note_failed_write(kv_chunk.room)" in conn
    pin = next(pin for pin in PINS if tree.name.startswith(pin))
    assert "available_size += pd_lifecycle.held_tokens()" in (tree / MEMORY_CHECK[pin]).read_text()
