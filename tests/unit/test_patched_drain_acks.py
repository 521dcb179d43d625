"""Drain acks that cannot lie in the backport series: the page-lifecycle module of patched trees (its decode half
runs sglang-harden's ``guards/drain_acks.py``, bundled) under forged acks, its own ``SGH_ABORT`` /
``SGH_ABORT_ACK`` frames (0.4.x, 0.5.10.post1) malformed, its prefill's acknowledgement sockets bounded, and the
splices that feed it (the ack's generation on 0.5.22+, the abort notice arming the acks first). Needs torch and
pyzmq: run with a pin's venv python, as ``scripts/run_tests.sh`` does.
"""

from __future__ import annotations

import inspect
import os
import random
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from test_patch import patched_trees
from test_patched_lifecycle import Allocator, load, receiver
from test_patched_lifecycle_04x import _prefill

torch = pytest.importorskip("torch")
zmq = pytest.importorskip("zmq")
pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FUZZ_EXAMPLES = int(os.environ.get("SGLANG_HARDEN_WIRE_FUZZ_EXAMPLES", "1000"))

PINS = ("0.4.9.post6", "0.5.10.post1", "0.5.18", "0.5.19", "0.5.23")
CONN = "sglang/srt/disaggregation/common/conn.py"
NUMBERED = 5  # the generation a 0.5.22+ stand-in receiver's abort notice carries


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return patched_trees(tmp_path_factory, PINS)


def _receiver(pin: str, room: int) -> Any:
    """A decode receiver whose transfer two prefill ranks write, as the pin's receiver says which: 0.4.x's
    Mooncake receiver (TP ranks 0, 1 of prefill DP group 1 of two: prefill engine ranks 2 and 3) or the common
    receiver (prefill attention TP 1, PP 2: unique ranks 0 and 1). On 0.5.22+ its notice carries a generation."""
    if pin.startswith("0.4."):
        rec = receiver(room, 2, target_tp_ranks=[0, 1], target_dp_group=1, prefill_tp_size=4, prefill_dp_size=2)
        del rec.prefill_info, rec.target_pp_ranks, rec.target_cp_ranks
        return rec
    rec = receiver(room, 2, target_tp_ranks=[0], target_pp_ranks=[0, 1],
                   prefill_info=SimpleNamespace(pp_size=2, attn_cp_size=1))
    if pin == "0.5.23":
        rec._abort_generation = None

        def ensure_abort_notified(force_arm: bool = False) -> None:  # 0.5.22+: arms a generation, then sends
            rec._abort_generation = NUMBERED
            rec._send_abort_notification()
            rec.abort_notified = True

        rec.ensure_abort_notified = ensure_abort_notified
    return rec


def _ranks(pin: str) -> list[int]:
    return [2, 3] if pin.startswith("0.4.") else [0, 1]


def _acker(lifecycle: ModuleType, pin: str) -> Callable[..., None]:
    """``note_ack`` as the pin's splice calls it: with the ack's generation on 0.5.22+ (default: the notice's;
    a module whose ``note_ack`` takes none, as before acks were checked, gets the room and rank only)."""
    if pin != "0.5.23" or "generation" not in inspect.signature(lifecycle.note_ack).parameters:
        return lambda room, rank, generation=None: lifecycle.note_ack(room, rank)
    return lambda room, rank, generation=NUMBERED: lifecycle.note_ack(room, rank, generation)


@pytest.fixture(params=PINS)
def pin(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _decode(trees: dict[str, Path], pin: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load(trees[pin], monkeypatch)


FORGERIES = ("before_transfer", "before_notice", "other_room", "untargeted_rank", "duplicate_rank", "stale_generation")


# abort notices carry a generation from 0.5.22 on: a stale one is a forgery there only
FORGERY_CASES = [(pin, forgery) for pin in PINS for forgery in FORGERIES
                 if forgery != "stale_generation" or pin == "0.5.23"]


@pytest.mark.parametrize(("pin", "forgery"), FORGERY_CASES)
def test_a_forged_ack_leaves_the_quarantined_pages_held(trees: dict[str, Path], pin: str, forgery: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each forgery alone, two acks' worth (as many as the transfer needs); then the two real acks release."""
    lifecycle = _decode(trees, pin, monkeypatch)
    alloc, rec, ranks = Allocator(), _receiver(pin, 61), _ranks(pin)
    ack = _acker(lifecycle, pin)
    lifecycle.note_published(alloc, receiver(62), [30])  # the ledger exists before the first forged ack
    if forgery == "before_transfer":
        for rank in ranks:
            ack(61, rank)
    lifecycle.note_published(alloc, rec, [5, 6, 7])
    if forgery == "before_notice":
        for rank in ranks:
            ack(61, rank)
    assert lifecycle.pages_to_free(alloc, torch.tensor([5, 6, 7])).tolist() == []
    forged = {"other_room": [(63, rank) for rank in ranks], "untargeted_rank": [(61, 4), (61, 5)],
              "duplicate_rank": [(61, ranks[0])] * 2,
              "stale_generation": [(61, rank, NUMBERED + step) for step in (-1, 1) for rank in ranks]}
    for args in forged.get(forgery, []):
        ack(*args)
    lifecycle.release_drained()
    assert alloc.freed == [], f"{forgery}: released pages prefill may still write"
    ignored = sum(lifecycle.dropped_acks().values())
    assert ignored == (1 if forgery == "duplicate_rank" else len(forged.get(forgery, ranks))), forgery
    for rank in ranks:
        ack(61, rank)
    lifecycle.release_drained()
    assert sorted(alloc.freed) == [5, 6, 7], "the real acks release"


def test_every_ignored_ack_is_counted(trees: dict[str, Path], pin: str, monkeypatch: pytest.MonkeyPatch) -> None:
    lifecycle = _decode(trees, pin, monkeypatch)
    alloc, rec, ranks = Allocator(), _receiver(pin, 61), _ranks(pin)
    generation = NUMBERED if pin == "0.5.23" else None
    ack = _acker(lifecycle, pin)
    lifecycle.note_published(alloc, receiver(62), [30])  # the ledger exists before the first forged ack
    for rank in ranks:
        ack(61, rank)  # before the transfer
    lifecycle.note_published(alloc, rec, [5, 6, 7])
    for rank in ranks:
        ack(61, rank)  # before its abort notice
    assert lifecycle.pages_to_free(alloc, torch.tensor([5, 6, 7])).tolist() == []
    assert rec.sent == [61]  # the notice went out
    for rank in ranks:
        ack(63, rank)  # a room without a transfer
    for rank in (4, 5, 1 << 30):
        ack(61, rank)  # ranks the transfer does not target
    ack(61, ranks[0])
    ack(61, ranks[0])  # the same rank again
    if generation is not None:
        for stale in (generation - 1, generation + 1):
            ack(61, ranks[1], stale)
    lifecycle.release_drained()
    assert alloc.freed == [] and lifecycle.quarantined_pages() == 3
    dropped = lifecycle.dropped_acks()
    assert dropped["no_live_transfer"] == 4 and dropped["notice_not_armed"] == 2
    assert dropped["rank_not_targeted"] == 3 and dropped["duplicate_rank"] == 1
    assert dropped.get("stale_generation", 0) == (2 if generation is not None else 0)
    ack(61, ranks[1])  # the second real ack
    lifecycle.release_drained()
    assert sorted(alloc.freed) == [5, 6, 7]


def _ack_table(node: Any) -> int:
    """Rooms decode's ack table holds (``_acks``, a dict per room, before it was bounded: the flood shows it grow)."""
    return len(node.acks) if hasattr(node, "acks") else len(node._acks)


def test_the_ack_table_holds_live_transfers_only_under_a_flood(trees: dict[str, Path], pin: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    lifecycle = _decode(trees, pin, monkeypatch)
    alloc, rec = Allocator(), _receiver(pin, 64)
    lifecycle.note_published(alloc, rec, [8, 9])
    lifecycle.pages_to_free(alloc, torch.tensor([8, 9]))
    rng = random.Random(39)
    ack = _acker(lifecycle, pin)
    for _ in range(5000):
        ack(rng.getrandbits(62), rng.getrandbits(8), rng.getrandbits(8))
    assert _ack_table(lifecycle.NODE) <= 1, "forged acks of rooms without a transfer are kept"
    for rank in _ranks(pin):
        ack(64, rank)
    lifecycle.release_drained()
    assert sorted(alloc.freed) == [8, 9] and _ack_table(lifecycle.NODE) == 0
    lifecycle.note_published(alloc, receiver(65), [10])
    lifecycle.note_committed(SimpleNamespace(bootstrap_room=65))
    assert _ack_table(lifecycle.NODE) == 0, "a committed transfer's entry goes with it"


MALFORMED_NOTICES = [
    [b"SGH_ABORT"], [b"SGH_ABORT", b"7"], [b"SGH_ABORT", b"7", b"127.0.0.1"],
    [b"SGH_ABORT", b"x", b"127.0.0.1", b"9000"], [b"SGH_ABORT", b"-7", b"127.0.0.1", b"9000"],
    [b"SGH_ABORT", b"7", b"\xff\xfe", b"9000"], [b"SGH_ABORT", b"7", b"host name;", b"9000"],
    [b"SGH_ABORT", b"7", b"127.0.0.1", b"65536"], [b"SGH_ABORT", b"7", b"127.0.0.1", b"0"],
    [b"SGH_ABORT", b"7", b"", b"9000"], [b"SGH_ABORT", b"7", b"127.0.0.1", b"9000", b"extra"],
    [b"SGH_ABORT", b"9" * 40, b"127.0.0.1", b"9000"],
]
MALFORMED_ACKS = [
    [b"SGH_ABORT_ACK"], [b"SGH_ABORT_ACK", b"7"], [b"SGH_ABORT_ACK", b"x", b"0"], [b"SGH_ABORT_ACK", b"7", b"y"],
    [b"SGH_ABORT_ACK", b"7", b"\xff"], [b"SGH_ABORT_ACK", b"7", b" 1"], [b"SGH_ABORT_ACK", b"7", b"0", b"0"],
    [b"SGH_ABORT_ACK", b"7", b"9" * 30],
]


@pytest.mark.parametrize("pin", ["0.4.9.post6", "0.5.10.post1"])
def test_malformed_own_frames_are_counted_and_dropped_and_the_listener_keeps_serving(
        trees: dict[str, Path], pin: str, monkeypatch: pytest.MonkeyPatch) -> None:
    lifecycle, manager = _prefill(trees[pin], monkeypatch)
    for frames in MALFORMED_NOTICES:
        assert lifecycle.abort_notice_received(manager, frames) is True, frames  # consumed, never raises
    for frames in MALFORMED_ACKS:
        assert lifecycle.ack_frames_received(frames) is True, frames  # never reaches upstream's unpacking
    dropped = lifecycle.dropped_acks()
    assert dropped == {"malformed_notice": len(MALFORMED_NOTICES), "malformed_ack": len(MALFORMED_ACKS)}
    assert manager.request_status == {} and manager.failures == {}
    manager.request_status[66] = 2
    assert lifecycle.abort_notice_received(manager, [b"SGH_ABORT", b"66", b"127.0.0.1", b"9"]) is True
    assert manager.request_status[66] == 0, "a well-formed notice after them is handled"
    assert lifecycle.ack_frames_received([b"66", b"4", b"0"]) is False  # upstream's status message passes


def test_0518_malformed_ranked_acks_are_dropped(trees: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    lifecycle = load(trees["0.5.18"], monkeypatch)
    for frames in ([b"ABORT_ACK", b"7"], [b"ABORT_ACK", b"7", b"y"], [b"ABORT_ACK", b"7", b"\xff"]):
        lifecycle.ranked_ack_received(frames)
    assert lifecycle.dropped_acks() == {"malformed_ack": 3}


def test_prefill_keeps_a_bounded_lru_of_ack_sockets_and_closes_the_evicted(
        trees: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    lifecycle, manager = _prefill(trees["0.4.9.post6"], monkeypatch)
    monkeypatch.setattr(lifecycle, "MAX_ACK_SOCKETS", 2, raising=False)  # (the unbounded cache had none)
    monkeypatch.setattr(lifecycle, "_ACK_SOCKETS", type(lifecycle._ACK_SOCKETS)())
    pulls = []
    for _ in range(3):
        pull = zmq.Context.instance().socket(zmq.PULL)
        pull.setsockopt(zmq.RCVTIMEO, 2000)
        pulls.append((pull, pull.bind_to_random_port("tcp://127.0.0.1")))
    try:
        for room, (_, port) in enumerate(pulls, start=70):
            lifecycle._send_ack_frames(manager, room, "127.0.0.1", port)
        endpoint = [f"tcp://127.0.0.1:{port}" for _, port in pulls]
        assert list(lifecycle._ACK_SOCKETS) == endpoint[1:], "one socket per decode endpoint, kept forever"
        for room, (pull, _) in enumerate(pulls, start=70):
            assert pull.recv_multipart() == [b"SGH_ABORT_ACK", str(room).encode(), b"1"]  # the evicted one's too
        lifecycle._send_ack_frames(manager, 80, "127.0.0.1", pulls[1][1])  # recently used ...
        evicted = lifecycle._ACK_SOCKETS[endpoint[2]]
        lifecycle._send_ack_frames(manager, 81, "127.0.0.1", pulls[0][1])  # ... so the third goes
        assert list(lifecycle._ACK_SOCKETS) == [endpoint[1], endpoint[0]] and evicted.closed
        assert pulls[0][0].recv_multipart()[1] == b"81"
    finally:
        for sock in lifecycle._ACK_SOCKETS.values():
            sock.close(linger=0)
        for pull, _ in pulls:
            pull.close(linger=0)


def test_0510_acks_name_the_rank_decode_expects(trees: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """0.5.10.post1's prefill names its rank as SGLang's ``_prefill_unique_rank`` does, which is what decode's
    receiver (target TP/PP/CP ranks) expects."""
    lifecycle, manager = _prefill(trees["0.5.10.post1"], monkeypatch)
    manager.attn_tp_rank, manager.pp_size, manager.attn_cp_size, manager.pp_rank, manager.attn_cp_rank = 1, 2, 1, 1, 0
    assert lifecycle.prefill_ack_rank(manager) == 3
    decode = _receiver("0.5.10.post1", 1)
    decode.target_tp_ranks = [1]
    assert lifecycle.expected_ack_ranks(decode) == {2, 3}


def test_the_splices_pass_the_generation_and_arm_before_the_notice(trees: dict[str, Path]) -> None:
    conn = (trees["0.5.23"] / CONN).read_text()
    assert "pd_lifecycle.note_ack(bootstrap_room, prefill_rank, generation)" in conn
    for pin in ("0.5.18", "0.5.19", "0.5.23"):
        text = (trees[pin] / CONN).read_text()
        notice = text.index("    def _send_abort_notification(self")
        body = text[notice:text.index("\n    def ", notice + 1)]
        first = body.index("pd_lifecycle.note_abort_notice(self)")
        assert first < body.index("send_multipart"), pin
        if "register_deferred_abort_room" in body:
            assert first < body.index("register_deferred_abort_room"), pin


def _own_frames(head: bytes) -> st.SearchStrategy[list[bytes]]:
    """``head`` and up to five frames: plausible fields (decimals of any size and sign, addresses, ports) or any
    bytes."""
    field = st.one_of(st.integers(-(2**70), 2**70).map(lambda n: str(n).encode()), st.binary(max_size=40),
                      st.sampled_from([b"127.0.0.1", b"::1", b"[::1]", b"", b"0", b"65535", b"65536", b" 1", b"1e3"]))
    return st.lists(field, max_size=5).map(lambda rest: [head, *rest])


@pytest.mark.parametrize("pin", ["0.4.9.post6", "0.5.10.post1"])
def test_fuzzed_own_frames_never_raise_and_change_only_what_they_name(
        trees: dict[str, Path], pin: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hypothesis, ``SGLANG_HARDEN_WIRE_FUZZ_EXAMPLES`` (1,000) cases per message type, ``SGH_ABORT`` at prefill and
    ``SGH_ABORT_ACK`` at decode, as a holder of the secret could send them (unsigned ones never get this far: the
    rank port drops them, tests/unit/test_patched_side_channels.py): each is consumed without raising (the
    listener keeps serving); a notice fails at most the room it names, and only a room prefill holds."""
    lifecycle, manager = _prefill(trees[pin], monkeypatch)
    ran = {"SGH_ABORT": 0, "SGH_ABORT_ACK": 0}
    manager.request_status[66] = 2  # a live room no fuzzed notice names (they name others or nothing valid)

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(frames=_own_frames(b"SGH_ABORT"))
    def notice(frames: list[bytes]) -> None:
        if len(frames) > 1 and frames[1] == b"66":
            return
        assert lifecycle.abort_notice_received(manager, frames) is True
        assert manager.request_status.get(66) == 2
        ran["SGH_ABORT"] += 1

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(frames=_own_frames(b"SGH_ABORT_ACK"))
    def ack(frames: list[bytes]) -> None:
        assert lifecycle.ack_frames_received(frames) is True
        ran["SGH_ABORT_ACK"] += 1

    notice()
    ack()
    assert min(ran.values()) >= FUZZ_EXAMPLES * 0.95, ("Hypothesis ran fewer cases than asked", ran)
