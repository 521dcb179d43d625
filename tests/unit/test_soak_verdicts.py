"""The soak's oracles judge only what they saw: a refusal carries the refusing guard's status and message, a clean
foreign-read verdict needs the KV tracer to have seen the served requests decode, and ``--compare`` needs the
vanilla run to show the harm."""

from __future__ import annotations

import pytest

from sglang_harden.testbed import soak_judging, soak_spec
from sglang_harden.testbed.soak_spec import SoakLoad

TOO_LONG = "Input length (803 tokens) exceeds the maximum allowed length (634 tokens). Use a shorter input"


@pytest.mark.parametrize(("status", "error", "verdict"), [
    (400, TOO_LONG, "refused"),
    (400, "The input (900 tokens) is longer than the model's context length (768 tokens).", "refused"),
    (503, "sglang-harden lifecycle: 12 pages quarantined (cap 8), retry later", "refused"),
    (500, TOO_LONG, "oversized_failed"),  # the message with a crash's status
    (400, "Bad Request", "oversized_failed"),  # a 400 no guard gave
    (503, "Service Unavailable", "oversized_failed"),
    (-1, "", "oversized_unanswered"),
    (200, "", "oversized_served"),
])
def test_an_oversized_prompt_is_refused_only_by_a_guards_answer(status: int, error: str, verdict: str) -> None:
    outcome = soak_spec.Outcome("oversized", "r", status, 1.0, None, 0, 4, error=error)
    assert outcome.verdict == verdict


def _report(outcomes: list[soak_spec.Outcome], traced: int, rows: int = 0) -> soak_judging.SoakReport:
    summary = soak_judging.summarize(outcomes, [], 1.0, SoakLoad(), 1600, 16)
    clean = {"leaked_tokens": 0, "double_frees": 0, "quarantined_pages": 0, "pool": {}}
    return soak_judging.SoakReport("hardened", {}, {}, 1.0, summary,
                                   {"rows": rows, "requests": int(bool(rows)), "tracer_errors": 0,
                                    "traced_first_decodes": traced},
                                   {"decode": dict(clean)})


def _served(n: int) -> list[soak_spec.Outcome]:
    return [soak_spec.Outcome("normal", f"r{i}", 200, 1.0, 0.1, 4, 4) for i in range(n)]


def test_zero_foreign_reads_count_only_when_the_tracer_saw_the_served_requests() -> None:
    assert _report(_served(20), traced=20).violations() == []
    assert _report(_served(20), traced=19).violations() == [], "95 % traced is enough"
    blind = _report(_served(20), traced=0).violations()
    assert len(blind) == 1 and "the KV tracer saw 0 first decode step(s) for 20 request(s) served" in blind[0]
    assert _report(_served(20), traced=18).violations(), "90 % traced: the clean verdict proves nothing"


def test_a_crashed_oversized_prompt_is_a_violation_not_a_refusal() -> None:
    crashed = soak_spec.Outcome("oversized", "big", 500, 1.0, None, 0, 4, error="Internal Server Error")
    assert _report([*_served(4), crashed], traced=4).violations() == ["1 request(s) oversized_failed"]


def test_the_vanilla_control_fired_only_with_harm_shown() -> None:
    assert not _report(_served(4), traced=4).control_fired()
    assert _report(_served(4), traced=4, rows=12).control_fired()
    served_big = soak_spec.Outcome("oversized", "big", 200, 1.0, None, 4, 4)
    assert _report([*_served(4), served_big], traced=5).control_fired()
