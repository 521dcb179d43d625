from sglang_harden.guards.admission import PendingRejection
from sglang_harden.guards.base import Verdict
from sglang_harden.guards.retire import RetireView, decide_final_send


def test_clean_request_sends():
    assert decide_final_send(RetireView("r", None, False)).verdict is Verdict.ALLOW


def test_pending_rejection_aborts_and_fails_sender():
    d = decide_final_send(RetireView("r", PendingRejection("too long", 400), False))
    assert d.verdict is Verdict.ABORT and d.status_code == 400 and d.fields["fail_sender"] is True
    assert "too long" in d.reason


def test_aborted_request_aborts():
    d = decide_final_send(RetireView("r", None, True))
    assert d.verdict is Verdict.ABORT and d.fields["fail_sender"] is True
