"""The page-lifecycle patch's module (``sglang/srt/mem_cache/pd_lifecycle.py`` of a patched tree), imported from the
file the series writes, on stand-ins for SGLang's allocator and receiver (CPU tensors for the index tensors its
free paths pass; it imports nothing of SGLang), and doctor's ``page_quarantine`` detector on pristine and patched
trees. Needs torch (the free paths filter index tensors): ``scripts/run_tests.sh`` runs it with a pin's venv python.
The real patched servers are ``tests/e2e/test_patched_lifecycle_e2e.py``.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from test_patch import load_series_module, make_tree, patched_trees

from sglang_harden.tools import patch as P
from sglang_harden.tools._detectors_transfer import detect_page_quarantine
from sglang_harden.tools._source import SourceTree

torch = pytest.importorskip("torch")

MODULE = "sglang/srt/mem_cache/pd_lifecycle.py"
ALL_PINS = P.available_pins(P.default_patches_dir())
# every series (0.5.18 brings drain acks, 0.4.x and 0.5.10.post1 an abort notice and acks of its own)
PINS = list(ALL_PINS)


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return patched_trees(tmp_path_factory, ("0.5.18", "0.5.19", "0.5.23"))


def load(tree: Path, monkeypatch: pytest.MonkeyPatch, mode: str | None = None, lifetime: str = "30") -> ModuleType:
    monkeypatch.setenv("SGLANG_HARDEN_TRANSFER_WRITE_LIFETIME_S", lifetime)
    return load_series_module(tree / MODULE, "SGLANG_HARDEN_LIFECYCLE", mode, monkeypatch)


class Allocator:
    """Page size 1: ``free`` takes token slots (= pages); what reaches it is recorded."""

    def __init__(self, size: int = 64) -> None:
        self.size, self.page_size, self.device, self.freed = size, 1, "cpu", []

    def free(self, index: Any) -> None:
        self.freed.extend(index.tolist())


def targets(tp_ranks: list[int], pp_ranks: tuple[int, ...] = (0,), cp_ranks: tuple[int, ...] = (0,),
            pp_size: int = 1, cp_size: int = 1) -> dict[str, Any]:
    """The fields of SGLang's common KV receiver (0.5.10+) that say which prefill ranks its transfer targets: the
    target TP/PP/CP ranks and prefill's PP and CP sizes (``prefill_info``, a ``PrefillServerInfo``)."""
    return {"target_tp_ranks": list(tp_ranks), "target_pp_ranks": list(pp_ranks), "target_cp_ranks": list(cp_ranks),
            "prefill_info": SimpleNamespace(pp_size=pp_size, attn_cp_size=cp_size)}


def receiver(room: int, ranks: int = 1, **fields: Any) -> Any:
    """A decode receiver whose transfer targets prefill ranks 0 .. ``ranks``-1 (TP only)."""
    sent: list[int] = []
    rec = SimpleNamespace(bootstrap_room=room, bootstrap_infos=[{"rank": r} for r in range(ranks)],
                          bootstrap_addr="127.0.0.1:8998", abort_notified=False, sent=sent,
                          **{**targets(list(range(ranks))), **fields})
    rec._send_abort_notification = lambda: sent.append(room)
    return rec


@pytest.fixture(params=["0.5.18", "0.5.19", "0.5.23"])
def lifecycle(request: pytest.FixtureRequest, trees: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load(trees[request.param], monkeypatch)


def test_every_series_carries_the_module() -> None:
    assert {"0.4.9.post6", "0.4.10.post2", "0.5.10.post1", "0.5.18", "0.5.23"} <= set(PINS)
    for pin in PINS:
        assert any(MODULE in p.targets for p in P.load_series(pin, P.default_patches_dir())), pin


def test_pages_of_a_transfer_still_writing_stay_out_until_every_rank_acks(lifecycle: ModuleType) -> None:
    alloc, rec = Allocator(), receiver(7, ranks=2)
    lifecycle.note_published(alloc, rec, [5, 6, 7])
    passed = lifecycle.pages_to_free(alloc, torch.tensor([5, 6, 7, 40]))
    assert passed.tolist() == [40]  # page 40 was never handed to a transfer
    assert lifecycle.quarantined_pages() == 3
    assert lifecycle.held_tokens() == 3  # SGLang's idle pool check counts them as held, not leaked
    assert rec.sent == [7]  # prefill was asked for its drain acknowledgement
    lifecycle.release_drained()
    assert alloc.freed == []  # no acknowledgement yet; time alone never releases
    lifecycle.note_ack(7, 0)
    lifecycle.release_drained()
    assert alloc.freed == []  # one of two prefill ranks
    lifecycle.note_ack(7, 1)
    lifecycle.release_drained()
    assert sorted(alloc.freed) == [5, 6, 7] and lifecycle.quarantined_pages() == 0
    assert lifecycle.pages_to_free(alloc, torch.tensor([5, 6, 7])).tolist() == [5, 6, 7]  # plain free pages now


def test_committed_transfers_free_at_once(lifecycle: ModuleType) -> None:
    alloc = Allocator()
    lifecycle.note_published(alloc, receiver(8), [1, 2])
    lifecycle.note_committed(SimpleNamespace(bootstrap_room=8))
    assert lifecycle.pages_to_free(alloc, torch.tensor([1, 2])).tolist() == [1, 2]
    assert lifecycle.quarantined_pages() == 0


def test_a_gone_sender_releases_its_pages(lifecycle: ModuleType) -> None:
    alloc = Allocator()
    lifecycle.note_published(alloc, receiver(9), [3, 4])
    assert lifecycle.pages_to_free(alloc, torch.tensor([3, 4])).tolist() == []
    lifecycle.note_sender_gone("127.0.0.1:8998")
    lifecycle.release_drained()
    assert sorted(alloc.freed) == [3, 4]


def test_paged_release_keeps_quarantined_page_ids_back(lifecycle: ModuleType) -> None:
    alloc = Allocator()
    alloc.page_size = 16
    lifecycle.note_published(alloc, receiver(10), [2, 3])
    first, second = lifecycle.page_ids_to_free(alloc, (torch.tensor([2]), torch.tensor([3, 1])))
    assert first.tolist() == [] and second.tolist() == [1]


def test_at_the_quarantine_cap_new_requests_are_refused_with_a_reason(
        trees: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_HARDEN_QUARANTINE_CAP_PAGES", "3")
    lifecycle = load(trees["0.5.23"], monkeypatch)
    alloc = Allocator()
    assert lifecycle.quarantine_refusal() is None  # no ledger yet
    lifecycle.note_published(alloc, receiver(14), [5, 6])
    lifecycle.pages_to_free(alloc, torch.tensor([5, 6]))
    assert lifecycle.quarantine_refusal() is None  # 2 pages held, cap 3
    lifecycle.note_published(alloc, receiver(15), [7])
    lifecycle.pages_to_free(alloc, torch.tensor([7]))
    reason = lifecycle.quarantine_refusal()
    assert reason is not None and "3 KV pages are quarantined (cap 3)" in reason
    lifecycle.note_ack(14, 0)
    lifecycle.release_drained()
    assert lifecycle.quarantine_refusal() is None  # the door opens again once pages left quarantine


def test_the_cap_defaults_to_a_quarter_of_the_pool_and_bad_values_refuse_to_start(
        trees: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    lifecycle = load(trees["0.5.23"], monkeypatch)
    alloc = Allocator(size=14)  # 16 ledger pages: cap 4
    lifecycle.note_published(alloc, receiver(16), [1, 2, 3, 4])
    lifecycle.pages_to_free(alloc, torch.tensor([1, 2, 3, 4]))
    assert "cap 4" in (lifecycle.quarantine_refusal() or "")
    for bad in ("-1", "many"):
        monkeypatch.setenv("SGLANG_HARDEN_QUARANTINE_CAP_PAGES", bad)
        with pytest.raises(ValueError, match="SGLANG_HARDEN_QUARANTINE_CAP_PAGES"):
            load(trees["0.5.23"], monkeypatch)


@pytest.mark.parametrize("pin", ["0.5.18", "0.5.19", "0.5.23"])
def test_the_decode_door_asks_the_cap_before_the_capacity_check(trees: dict[str, Path], pin: str) -> None:
    decode = (trees[pin] / "sglang/srt/disaggregation/decode.py").read_text()
    door = decode.index("if not is_retracted and not is_rebootstrap and self._quarantine_full(req):")
    capacity_check = "        if self._check_if_req_exceed_kv_capacity(req):\n            return\n"
    assert door < decode.index(capacity_check, door - 200)
    method = decode[decode.index("    def _quarantine_full(self, req: Req) -> bool:"):]
    assert "pd_lifecycle.quarantine_refusal()" in method and "HTTPStatus.SERVICE_UNAVAILABLE" in method


def test_log_mode_frees_and_off_keeps_no_ledger(trees: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    logged = load(trees["0.5.23"], monkeypatch, "log")
    alloc = Allocator()
    logged.note_published(alloc, receiver(11), [5, 6])
    assert logged.pages_to_free(alloc, torch.tensor([5, 6])).tolist() == [5, 6]
    off = load(trees["0.5.23"], monkeypatch, "off")
    off.note_published(alloc, receiver(12), [5, 6])
    assert off.NODE is None and off.deferred_release(False) is False
    assert logged.deferred_release(False) is True


def test_prefill_holds_the_ack_of_a_failed_write_for_its_lifetime(trees: dict[str, Path],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    lifecycle = load(trees["0.5.23"], monkeypatch, lifetime="0.3")
    sent: list[int] = []
    assert lifecycle.ack_deferred(21, lambda: sent.append(21)) is False  # no failed write: ack now
    assert lifecycle.note_failed_write(22) is True  # the caller keeps the ack target
    assert lifecycle.ack_deferred(22, lambda: sent.append(22)) is True
    deadline = time.monotonic() + 5
    while not sent and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sent == [22]  # the timer sent it again once the lifetime passed
    assert lifecycle.ack_deferred(22, lambda: None) is False


def test_lifetime_zero_never_acks_a_failed_write_and_bad_values_refuse_to_start(
        trees: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    forever = load(trees["0.5.23"], monkeypatch, lifetime="0")
    forever.note_failed_write(23)
    assert forever.ack_deferred(23, lambda: None) is True
    with pytest.raises(ValueError, match="SGLANG_HARDEN_TRANSFER_WRITE_LIFETIME_S"):
        load(trees["0.5.23"], monkeypatch, lifetime="soon")
    with pytest.raises(ValueError, match="SGLANG_HARDEN_LIFECYCLE"):
        load(trees["0.5.23"], monkeypatch, mode="sometimes")


def test_doctor_sees_the_quarantine_only_on_patched_trees(trees: dict[str, Path], tmp_path: Path) -> None:
    for pin, tree in trees.items():
        assert detect_page_quarantine(SourceTree(tree)).status == "yes", pin
        assert detect_page_quarantine(SourceTree(make_tree(pin, tmp_path / pin))).status == "no", pin


class MooncakeManager:
    """Stands in for 0.5.18's Mooncake KV manager on prefill (a real one needs a transfer engine; the real
    manager is ``tests/e2e/test_patched_lifecycle_e2e.py --pins 0.5.18``): its in-flight chunk counts, its rank
    and what it sends."""

    def __init__(self) -> None:
        self._staging_outstanding: dict[int, int] = {}
        self.attn_tp_rank, self.pp_size, self.attn_cp_size, self.pp_rank, self.attn_cp_rank = 1, 1, 1, 0, 0
        self.sent: list[tuple[str, list[bytes]]] = []

    def _send_multipart_locked(self, endpoint: str, parts: list[bytes], is_ipv6: bool = False) -> None:
        self.sent.append((endpoint, parts))


def _stub_network_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """``sglang.srt.utils.network.NetworkAddress`` for a test without SGLang installed (what send_drain_ack uses)."""
    import sys
    import types

    class NetworkAddress:
        def __init__(self, host: str, port: int) -> None:
            self.host, self.port, self.is_ipv6 = host, port, False

        def to_tcp(self) -> str:
            return f"tcp://{self.host}:{self.port}"

    names = ["sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.utils.network"]
    for name in names:
        if name not in sys.modules:
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setattr(sys.modules["sglang.srt.utils.network"], "NetworkAddress", NetworkAddress, raising=False)


def test_0518_prefill_acknowledges_an_abort_only_once_the_rooms_chunks_drained(
        trees: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    lifecycle = load(trees["0.5.18"], monkeypatch)
    _stub_network_address(monkeypatch)
    manager = MooncakeManager()
    manager._staging_outstanding[31] = 1  # a chunk of room 31 is being written
    assert lifecycle.ack_when_drained(manager, 31, "127.0.0.1", 9100) is True  # upstream's own ack is skipped
    assert manager.sent == []
    manager._staging_outstanding[31] = 0  # the worker finished the chunk ...
    lifecycle.ack_if_drained(manager, 31)  # ... and tells the module
    assert manager.sent == [("tcp://127.0.0.1:9100", [b"ABORT_ACK", b"31", b"1"])]
    lifecycle.ack_if_drained(manager, 31)
    assert len(manager.sent) == 1  # at most once
    assert lifecycle.ack_when_drained(manager, 32, "127.0.0.1", 9100) is True  # nothing in flight: at once
    assert manager.sent[-1][1] == [b"ABORT_ACK", b"32", b"1"]


def test_0518_a_failed_write_holds_the_drain_ack_and_off_leaves_upstreams(
        trees: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    lifecycle = load(trees["0.5.18"], monkeypatch, lifetime="0")
    _stub_network_address(monkeypatch)
    manager = MooncakeManager()
    lifecycle.note_failed_write(33)
    assert lifecycle.ack_when_drained(manager, 33, "127.0.0.1", 9100) is True
    assert manager.sent == []  # lifetime 0: never by itself
    off = load(trees["0.5.18"], monkeypatch, mode="off")
    assert off.ack_when_drained(manager, 34, "127.0.0.1", 9100) is False


def test_0518_series_counts_chunks_before_the_status_check_and_decode_counts_ranked_acks(
        trees: dict[str, Path]) -> None:
    conn = (trees["0.5.18"] / "sglang/srt/disaggregation/mooncake/conn.py").read_text()
    count = conn.index("# sglang-harden backport: count the chunk in flight")
    assert count < conn.index("kv_chunk.room not in self.request_status", count)
    assert "pd_lifecycle.ack_when_drained(" in conn and conn.count("pd_lifecycle.ack_if_drained(") == 2
    assert "pd_lifecycle.ranked_ack_received(msg)" in conn


class DrainingManager:
    """Stands in for 0.5.19's common KV manager on prefill (its drain-ack target table, in-flight chunk counts and
    ``_maybe_ack_drained_abort``: ack once nothing of the room is outstanding, at most once; a real manager needs
    a transfer engine: tests/e2e/test_side_channels_e2e.py's forged-drain-ack case runs 0.5.19's patched tree)."""

    def __init__(self) -> None:
        self._deferred_ack_targets: dict[int, tuple[str, int]] = {}
        self._staging_outstanding: dict[int, int] = {}
        self.acked: list[int] = []

    def _maybe_ack_drained_abort(self, room: int) -> None:
        if self._staging_outstanding.get(room, 0) > 0:
            return
        if self._deferred_ack_targets.pop(room, None) is not None:
            self.acked.append(room)


def test_0519_clear_keeps_the_ack_target_of_a_room_still_being_written(
        trees: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """0.5.19's clear() dropped a room's drain-ack target while its chunk was still being written, so the worker
    found none when the write drained: decode never got its ack and held the pages in quarantine for good."""
    conn = (trees["0.5.19"] / "sglang/srt/disaggregation/common/conn.py").read_text()
    assert "pd_lifecycle.settle_ack_target(self.kv_mgr, self.bootstrap_room)" in conn
    assert "self.kv_mgr._deferred_ack_targets.pop(self.bootstrap_room, None)" not in conn
    lifecycle = load(trees["0.5.19"], monkeypatch)
    manager = DrainingManager()
    manager._deferred_ack_targets[41], manager._staging_outstanding[41] = ("127.0.0.1", 9100), 1
    lifecycle.settle_ack_target(manager, 41)  # the scheduler concluded the room while its chunk is in flight
    assert 41 in manager._deferred_ack_targets and manager.acked == []
    manager._staging_outstanding[41] = 0
    manager._maybe_ack_drained_abort(41)  # the worker, once the write drained
    assert manager.acked == [41]
    manager._deferred_ack_targets[42] = ("127.0.0.1", 9100)
    lifecycle.settle_ack_target(manager, 42)  # nothing in flight: acknowledged now
    assert manager.acked == [41, 42]
    for mode in ("log", "off"):  # upstream's drop
        upstream = load(trees["0.5.19"], monkeypatch, mode)
        manager._deferred_ack_targets[43], manager._staging_outstanding[43] = ("127.0.0.1", 9100), 1
        upstream.settle_ack_target(manager, 43)
        assert 43 not in manager._deferred_ack_targets and manager.acked == [41, 42], mode
