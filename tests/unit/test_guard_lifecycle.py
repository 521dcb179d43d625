import pytest

from sglang_harden.guards.base import Verdict
from sglang_harden.guards.lifecycle import (
    LedgerError,
    PageLedger,
    PageState,
    default_quarantine_cap,
    split_into_windows,
)


def test_reserve_stamps_owner_generation_and_state():
    ledger = PageLedger(4)
    g1 = ledger.reserve("a", [0, 1])
    g2 = ledger.reserve("b", [2])
    assert g2 > g1
    assert [ledger.owner(p) for p in range(4)] == ["a", "a", "b", None]
    assert ledger.generation(0) == g1 and ledger.state(0) is PageState.RESERVED


def test_reserve_refuses_a_page_that_is_not_free_and_changes_nothing():
    ledger = PageLedger(3)
    ledger.reserve("a", [1])
    with pytest.raises(LedgerError, match="page 1"):
        ledger.reserve("b", [0, 1])
    assert ledger.state(0) is PageState.FREE


def test_clean_lifecycle_frees_everything():
    ledger = PageLedger(2)
    ledger.reserve("a", [0, 1])
    assert ledger.begin_write("a", [0, 1]) == []
    assert ledger.finish_write("a", [0, 1]) == []
    out = ledger.release("a", [0, 1], writer_drained=False)
    assert (out.to_free, out.to_quarantine) == ([0, 1], [])
    assert ledger.owner(0) is None and ledger.state(1) is PageState.FREE


def test_timeout_with_write_in_flight_quarantines_never_frees():
    ledger = PageLedger(3)
    ledger.reserve("a", [0, 1, 2])
    ledger.begin_write("a", [0, 1])
    out = ledger.release("a", [0, 1, 2], writer_drained=False)
    assert out.to_quarantine == [0, 1] and out.to_free == [2]
    assert ledger.quarantined_count() == 2 and ledger.owner(0) == "a"
    assert ledger.confirm_drained("a") == [0, 1]
    assert ledger.quarantined_count() == 0 and ledger.state(0) is PageState.FREE
    assert ledger.confirm_drained("a") == []


def test_drained_writer_frees_directly():
    ledger = PageLedger(1)
    ledger.reserve("a", [0])
    ledger.begin_write("a", [0])
    assert ledger.release("a", [0], writer_drained=True).to_free == [0]


def test_double_release_and_foreign_release_are_ignored():
    ledger = PageLedger(2)
    ledger.reserve("a", [0])
    ledger.reserve("b", [1])
    assert ledger.release("a", [0], True).to_free == [0]
    again = ledger.release("a", [0, 1], True)
    assert again.to_free == [] and again.ignored == [0, 1]
    assert ledger.owner(1) == "b"


def test_writes_by_non_owner_are_refused():
    ledger = PageLedger(2)
    ledger.reserve("a", [0])
    assert ledger.begin_write("b", [0]) == [0]
    assert ledger.finish_write("a", [0]) == [0]  # never began
    assert ledger.state(0) is PageState.RESERVED


def test_admission_closes_at_quarantine_cap():
    ledger = PageLedger(8)
    ledger.reserve("a", [0, 1])
    ledger.begin_write("a", [0, 1])
    assert ledger.admission_open(2).verdict is Verdict.ALLOW
    ledger.release("a", [0, 1], writer_drained=False)
    d = ledger.admission_open(2)
    assert d.verdict is Verdict.REJECT and d.status_code == 503
    assert ledger.admission_open(0).fields["cap"] == default_quarantine_cap(8) == 2


def test_source_settles_only_when_no_write_can_land():
    from sglang_harden.guards.lifecycle import FAILED_WRITE_EXPIRED, SourceEvidence, source_settled

    assert source_settled(SourceEvidence(0, True), 30.0)
    assert not source_settled(SourceEvidence(1, False), 30.0)  # a chunk still queued or in flight
    assert not source_settled(SourceEvidence(0, False), 30.0)  # status not final yet
    assert not source_settled(SourceEvidence(0, True, 29.9), 30.0)  # a failed write may still land
    assert source_settled(SourceEvidence(0, True, 30.0), 30.0)
    assert not source_settled(SourceEvidence(0, True, FAILED_WRITE_EXPIRED), 0.0)  # lifetime 0: never by age


def test_writer_drained_needs_every_ack_or_a_known_end():
    from sglang_harden.guards.lifecycle import DrainEvidence, writer_drained

    assert not writer_drained(DrainEvidence(2, 1))
    assert writer_drained(DrainEvidence(2, 2))
    assert not writer_drained(DrainEvidence(0, 0))  # nothing to count: no ack is no proof
    assert writer_drained(DrainEvidence(2, 0, sender_gone=True))
    assert writer_drained(DrainEvidence(2, 0, never_started=True))


def test_snapshot_restore_roundtrip():
    ledger = PageLedger(4)
    ledger.reserve("a", [0, 1])
    ledger.begin_write("a", [0])
    ledger.release("a", [0, 1], writer_drained=False)
    ledger.reserve("b", [2])
    snap = ledger.snapshot()
    back = PageLedger.restore(snap)
    assert back.snapshot() == snap
    assert back.quarantined_count() == 1 and back.confirm_drained("a") == [0]
    assert back.reserve("c", [0]) > ledger.generation(2)


def test_split_into_windows():
    assert split_into_windows([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
    assert split_into_windows([], 3) == []
    with pytest.raises(ValueError):
        split_into_windows([1], 0)
