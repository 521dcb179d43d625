from sglang_harden.guards.admission import AdmissionView, PendingRejection, decide_admission
from sglang_harden.guards.base import Verdict


def view(prompt_len=10, pending=None, limit=250, role="prefill"):
    return AdmissionView("r1", role, prompt_len, pending, limit)


def test_fits_is_allowed():
    assert decide_admission(view(250)).verdict is Verdict.ALLOW


def test_pending_rejection_keeps_its_own_message_and_status():
    d = decide_admission(view(pending=PendingRejection("boom", 413)))
    assert (d.verdict, d.reason, d.status_code) == (Verdict.REJECT, "boom", 413)


def test_pending_default_status_is_400():
    assert decide_admission(view(pending=PendingRejection("x"))).status_code == 400


def test_too_long_names_both_numbers():
    d = decide_admission(view(300, limit=250))
    assert d.verdict is Verdict.REJECT and d.status_code == 400
    assert "300" in d.reason and "250" in d.reason and "exceeds" in d.reason


def test_unknown_limit_fails_closed():
    d = decide_admission(view(limit=None, role="decode"))
    assert d.verdict is Verdict.REJECT and d.status_code == 500
    assert "decode" in d.reason and "max_req_input_len" in d.reason


def test_front_refuses_what_the_scheduler_will_refuse_with_its_message():
    from sglang_harden.guards.admission import FrontView, decide_at_front

    at_limit = decide_at_front(FrontView("r", prompt_len=634, limit=634, truncates=False))
    assert at_limit.verdict is Verdict.REJECT and at_limit.status_code == 400
    assert at_limit.reason == ("Input length (634 tokens) exceeds the maximum allowed length (634 tokens). "
                               "Use a shorter input or enable --allow-auto-truncate.")
    assert decide_at_front(FrontView("r", prompt_len=633, limit=634, truncates=False)).allows


def test_front_leaves_what_it_cannot_be_sure_of_to_the_doors():
    from sglang_harden.guards.admission import FrontView, decide_at_front

    assert decide_at_front(FrontView("r", prompt_len=900, limit=634, truncates=True)).allows
    assert decide_at_front(FrontView("r", prompt_len=900, limit=None, truncates=False)).allows
    assert decide_at_front(FrontView("r", prompt_len=None, limit=634, truncates=False)).allows
