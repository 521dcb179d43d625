"""The evidence every guard decision leaves: a count (and Prometheus counter) plus one structured log line."""

from __future__ import annotations

import json
import logging

import pytest

from sglang_harden import events
from sglang_harden.config import Mode
from sglang_harden.guards.base import Decision, Verdict, allow

REJECT = Decision("admission", Verdict.REJECT, "Input length (300 tokens) exceeds", 400, {"rid": "B"})


@pytest.fixture(autouse=True)
def clean_counts() -> None:
    events.reset_for_tests()


def _lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, object]]:
    out = []
    for record in caplog.records:
        text = record.getMessage()
        if text.startswith(events.LOG_TAG + " "):
            out.append(json.loads(text.split(" ", 1)[1]))
    return out


def test_enforced_rejection_is_counted_logged_and_applied(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="sglang_harden"):
        assert events.record(REJECT, Mode.ENFORCE, room=7) is True
    assert events.snapshot() == {"admission:reject": 1}
    (line,) = _lines(caplog)
    assert (line["guard"], line["decision"], line["room"], line["status_code"]) == ("admission", "reject", 7, 400)


def test_log_mode_counts_under_its_own_label_and_does_not_apply(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="sglang_harden"):
        assert events.record(REJECT, Mode.LOG) is False
    assert events.snapshot() == {"admission:reject_logged": 1}
    assert _lines(caplog)[0]["decision"] == "reject_logged"


def test_off_mode_decides_nothing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="sglang_harden"):
        assert events.record(REJECT, Mode.OFF) is False
    assert events.snapshot() == {} and _lines(caplog) == []


def test_allow_is_counted_and_logged_only_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="sglang_harden"):
        assert events.record(allow("lifecycle", room=1), Mode.ENFORCE) is False
    assert events.snapshot() == {"lifecycle:allow": 1} and _lines(caplog) == []
    with caplog.at_level(logging.DEBUG, logger="sglang_harden"):
        events.record(allow("lifecycle", room=2), Mode.ENFORCE)
    assert _lines(caplog)[-1]["room"] == 2


def test_tally_counts_each_allow_and_snapshot_folds_them(caplog: pytest.LogCaptureFixture) -> None:
    tally = events.Tally(allow("page_tags"))
    with caplog.at_level(logging.INFO, logger="sglang_harden"):
        events.refresh_log_level()
        for room in range(5):
            tally.bump(Mode.ENFORCE, room=room)
        tally.bump(Mode.LOG, room=5)
        tally.bump(Mode.OFF, room=6)  # off decides nothing
    assert events.snapshot() == {"page_tags:allow": 6} and _lines(caplog) == []
    assert events.snapshot() == {"page_tags:allow": 6}  # folded once, not again


def test_tally_writes_each_decisions_line_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    tally = events.Tally(allow("lifecycle"))
    with caplog.at_level(logging.DEBUG, logger="sglang_harden"):
        events.refresh_log_level()
        tally.bump(Mode.ENFORCE, room=41)
        tally.bump(Mode.ENFORCE, room=42)
    events.refresh_log_level()
    assert [line["room"] for line in _lines(caplog)] == [41, 42]
    assert events.snapshot() == {"lifecycle:allow": 2}


def test_only_allowing_decisions_are_tallied() -> None:
    with pytest.raises(ValueError, match="only an allowing decision"):
        events.Tally(REJECT)
