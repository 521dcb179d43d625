"""The model runs production's lifecycle rules (``guards.lifecycle.source_settled`` and ``writer_drained``, the
functions ``compat/lifecycle_nodes.py`` calls on a real server), so a change to those rules is a change to what the
model checks: mutate one and the explorer finds the violation. Also the events that make the rules matter: a write
that outlives the write lifetime (the residual risk that setting trades against), a lost drain ack, a sender
known gone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from sglang_harden.guards import lifecycle
from sglang_harden.protocol.explorer import check_policy
from sglang_harden.protocol.scenarios import build_config
from sglang_harden.protocol.world import RequestSpec

SHARED = (RequestSpec(2), RequestSpec(1))  # r1 reuses r0's pages
FOREIGN_READS = ("late_write_read", "source_reuse_read", "stale_read", "unwritten_read")


def check(config: Any, depth: int = 60, **kwargs: Any) -> Any:
    result = check_policy("hardened", config, depth=depth, **kwargs)
    print(result.summary())
    for counterexample in result.counterexamples.values():
        print(counterexample.format())
    return result


def counting(rule: Callable[..., bool], calls: list[int]) -> Callable[..., bool]:
    def counted(*args: Any) -> bool:
        calls.append(1)
        return rule(*args)

    return counted


def test_the_model_asks_the_production_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    settled_calls: list[int] = []
    drained_calls: list[int] = []
    monkeypatch.setattr(lifecycle, "source_settled", counting(lifecycle.source_settled, settled_calls))
    monkeypatch.setattr(lifecycle, "writer_drained", counting(lifecycle.writer_drained, drained_calls))
    result = check(build_config(specs=SHARED, pages=3), depth=30)
    assert not result.counterexamples
    assert settled_calls and drained_calls


MUTANTS: dict[str, tuple[str, Callable[..., bool]]] = {
    # prefill lets source pages go (and acks) while a failed write may still land
    "settled ignores failed writes": ("source_settled",
                                      lambda evidence, lifetime: evidence.chunks_outstanding == 0
                                      and evidence.transfer_ended),
    # prefill lets source pages go while chunks are still queued or in flight
    "settled ignores outstanding chunks": ("source_settled",
                                           lambda evidence, lifetime: evidence.failed_write_age_s is None),
    # decode ends quarantine without any evidence (a bare timeout counted as a drain)
    "drained on no evidence": ("writer_drained", lambda evidence: True),
}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_a_mutated_production_rule_is_caught(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    attribute, mutant = MUTANTS[name]
    monkeypatch.setattr(lifecycle, attribute, mutant)
    result = check(build_config(specs=SHARED, pages=3), stop_when=FOREIGN_READS)
    assert set(result.counterexamples) & set(FOREIGN_READS), result.summary()


def test_a_write_outliving_its_lifetime_is_the_residual_risk() -> None:
    """With the expiry event, the explorer shows the trace the setting trades against: the transport gave up on a
    write, its lifetime passed, prefill settled the room and acked, decode freed the pages to the next request,
    and the write landed there. docs/guards.md "Residual risk" cites this test."""
    config = build_config(specs=SHARED, pages=3, write_lifetime=True)
    result = check(config, stop_when=("late_write_read",))
    counterexample = result.counterexamples.get("late_write_read")
    assert counterexample is not None, result.summary()
    assert "outlives the write lifetime" in counterexample.format()
    # without the expiry event the same scenario is clean: test_hardened.test_hardened_explores_over_100k_states...


def test_a_lost_ack_holds_pages_until_the_sender_is_known_gone() -> None:
    """Lost drain acks and senders found gone: no foreign read anywhere; pages whose ack was lost stay in
    quarantine (by design, bounded by the cap) until decode learns the sender is gone."""
    config = build_config(specs=SHARED, pages=3, lost_acks=True)
    result = check(config)
    assert result.exhausted and not result.counterexamples, result.summary()


def test_a_lost_ack_without_the_rule_for_gone_senders_leaks(monkeypatch: pytest.MonkeyPatch) -> None:
    """If "sender gone" did not end quarantine, a lost ack would hold pages for good: the model sees the leak."""
    monkeypatch.setattr(lifecycle, "writer_drained", lambda evidence: evidence.required_acks > 0
                        and evidence.acks >= evidence.required_acks)
    monkeypatch.setattr("sglang_harden.protocol.policies.HardenedPolicy.held_by_design", lambda self, w: 0)
    result = check(build_config(specs=SHARED, pages=3, lost_acks=True), stop_when=("leak_at_quiesce",))
    assert "leak_at_quiesce" in result.counterexamples, result.summary()
