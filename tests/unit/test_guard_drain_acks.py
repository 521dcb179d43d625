"""Which drain acks count (``guards/drain_acks.py``, the rule the plugin's decode node and the backport series'
``pd_lifecycle`` both run): only for a live transfer, once its abort notice was armed, at the notice's generation,
from a rank the transfer targets, each rank once; the table holds live transfers only, and at most its cap."""

from __future__ import annotations

import random

from sglang_harden.guards import drain_acks
from sglang_harden.guards.base import Verdict
from sglang_harden.guards.drain_acks import AckBook, AckCount


def _armed(book: AckBook, room: int, ranks: tuple[int, ...], generation: int | None = None) -> AckBook:
    assert book.open(room, ranks, generation=lambda: generation).allows
    book.arm(room)
    return book


def _why(book: AckBook, room: int, rank: int, generation: int | None = None) -> str | None:
    decision = book.note(room, rank, generation)
    return None if decision.verdict is Verdict.ALLOW else str(decision.fields["why"])


def test_every_targeted_rank_once_is_what_drains() -> None:
    book = _armed(AckBook(), 7, (0, 1))
    assert _why(book, 7, 0) is None
    assert book.count(7) == AckCount(required=2, acked=1)
    assert _why(book, 7, 0) == drain_acks.DUPLICATE  # the same rank again: ignored
    assert book.count(7) == AckCount(2, 1)
    assert _why(book, 7, 1) is None
    assert book.count(7) == AckCount(2, 2)


def test_a_duplicate_is_skipped_and_every_other_refusal_is_a_reject() -> None:
    book = _armed(AckBook(), 7, (0,))
    book.note(7, 0)
    assert book.note(7, 0).verdict is Verdict.SKIP
    assert book.note(8, 0).verdict is Verdict.REJECT
    assert book.note(7, 3).verdict is Verdict.REJECT
    assert "drain ack ignored" in book.note(8, 0).reason


def test_an_ack_for_a_room_without_a_live_transfer_never_counts_even_once_one_begins() -> None:
    book = AckBook()
    assert _why(book, 7, 0) == drain_acks.NO_TRANSFER  # before the transfer
    _armed(book, 7, (0,))
    assert book.count(7) == AckCount(1, 0)  # the early ack was not kept for later
    book.close(7)
    assert _why(book, 7, 0) == drain_acks.NO_TRANSFER  # after it
    assert book.count(7) == AckCount(0, 0)


def test_an_ack_before_the_abort_notice_was_armed_does_not_count() -> None:
    book = AckBook()
    book.open(7, (0,))
    assert _why(book, 7, 0) == drain_acks.NOT_ARMED
    book.arm(7)
    assert _why(book, 7, 0) is None


def test_a_notice_already_sent_when_the_transfer_began_is_armed() -> None:
    book = AckBook()
    book.open(7, (0,), armed=True)
    assert _why(book, 7, 0) is None


def test_only_the_generation_the_notice_carries_counts() -> None:
    current = {"generation": 4}
    book = AckBook()
    book.open(7, (0, 1), generation=lambda: current["generation"])
    book.arm(7)
    assert _why(book, 7, 0, 3) == drain_acks.STALE  # an earlier use of the room
    assert _why(book, 7, 0, 5) == drain_acks.STALE  # a guess ahead
    assert _why(book, 7, 0, None) == drain_acks.STALE  # none where the notice carries one
    assert _why(book, 7, 0, 4) is None
    current["generation"] = 6  # the room was armed again: the old generation's acks stop counting
    assert _why(book, 7, 1, 4) == drain_acks.STALE
    unnumbered = _armed(AckBook(), 8, (0,))
    assert _why(unnumbered, 8, 0, 1) == drain_acks.STALE  # a numbered ack for a notice that carried none


def test_a_rank_the_transfer_does_not_target_never_counts() -> None:
    book = _armed(AckBook(), 7, (2, 3))
    for rank in (0, 1, 4, 1 << 40):
        assert _why(book, 7, rank) == drain_acks.NOT_TARGETED
    assert book.count(7) == AckCount(2, 0)


def test_a_transfer_whose_targets_are_unknown_takes_no_ack() -> None:
    book = AckBook()
    opened = book.open(7, None)
    assert not opened.allows and opened.fields["why"] == drain_acks.UNKNOWN_RANKS
    book.arm(7)
    assert _why(book, 7, 0) == drain_acks.UNKNOWN_RANKS
    assert book.count(7) == AckCount(0, 0)


def test_a_new_transfer_of_a_room_starts_without_the_old_ones_acks() -> None:
    book = _armed(AckBook(), 7, (0, 1))
    book.note(7, 0)
    _armed(book, 7, (0, 1))
    assert book.count(7) == AckCount(2, 0)


def test_the_table_holds_live_transfers_only_under_a_flood_of_forged_acks() -> None:
    book = _armed(AckBook(), 7, (0,))
    rng = random.Random(39)
    for _ in range(20000):
        book.note(rng.getrandbits(63), rng.getrandbits(16), rng.getrandbits(8))
    assert len(book) == 1 and book.count(7) == AckCount(1, 0)
    book.close(7)
    assert len(book) == 0


def test_past_the_cap_the_oldest_entry_goes_and_says_so() -> None:
    book = AckBook(cap=3)
    for room in (1, 2, 3):
        _armed(book, room, (0,))
    evicted = book.open(4, (0,))
    assert not evicted.allows and evicted.fields == {**evicted.fields, "why": drain_acks.EVICTED, "room": 1}
    assert len(book) == 3
    book.arm(4)
    assert _why(book, 1, 0) == drain_acks.NO_TRANSFER  # its pages now wait for the sender to be gone
    assert _why(book, 4, 0) is None
