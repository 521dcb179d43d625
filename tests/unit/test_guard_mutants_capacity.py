"""The capacity gate at its boundary: a pool one token short of the advertised context is refused (and clamped by
exactly that token).

A mutant that moved the bound by one (``max_req_input_len >= context_len - margin - 1``) survived the gate's own
tests, which only checked pools far too small (scripts/mutate_guards.py, docs/mutations.md).
"""

from sglang_harden.config import CapacityMode
from sglang_harden.guards.base import Verdict
from sglang_harden.guards.capacity import SGLANG_MARGIN, decide_capacity


def test_a_pool_one_token_short_of_the_context_is_refused():
    fits = 512 - SGLANG_MARGIN
    assert decide_capacity(512, fits, SGLANG_MARGIN, CapacityMode.ENFORCE).verdict is Verdict.ALLOW
    assert decide_capacity(512, fits - 1, SGLANG_MARGIN, CapacityMode.ENFORCE).verdict is Verdict.REJECT
    clamped = decide_capacity(512, fits - 1, SGLANG_MARGIN, CapacityMode.CLAMP)
    assert clamped.verdict is Verdict.CLAMP and clamped.fields["context_len"] == 511
