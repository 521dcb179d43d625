"""The admission door's length check at its boundary: one token over ``max_req_input_len`` is refused.

A mutant that moved the bound by one (``prompt_len > limit + 1``) survived the guard's own tests, which only
checked a prompt far over the limit (scripts/mutate_guards.py, docs/mutations.md).
"""

from sglang_harden.guards.admission import AdmissionView, decide_admission
from sglang_harden.guards.base import Verdict


def test_one_token_over_the_limit_is_refused_at_both_doors():
    for role in ("prefill", "decode"):
        d = decide_admission(AdmissionView("r1", role, 251, None, 250))
        assert d.verdict is Verdict.REJECT and d.status_code == 400
        assert "251" in d.reason and "250" in d.reason
        assert decide_admission(AdmissionView("r1", role, 250, None, 250)).allows
