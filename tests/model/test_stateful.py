"""Hypothesis drives the same model with random event sequences (fixed-seed CI profile by default).

Profiles: ``SGLANG_HARDEN_MODEL_PROFILE=model-ci`` (default: derandomized, 40 runs of 40 steps) or
``model-big`` (2,000 runs of 120 steps, random seeds) for a longer soak.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from sglang_harden.protocol.model import EXTERNAL, Model
from sglang_harden.protocol.policies import make_policy
from sglang_harden.protocol.scenarios import INCIDENT_REQUESTS, build_config
from sglang_harden.protocol.world import RequestSpec

settings.register_profile(
    "model-ci",
    max_examples=40,
    stateful_step_count=40,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("model-big", max_examples=2000, stateful_step_count=120, deadline=None)
PROFILE = settings.get_profile(os.environ.get("SGLANG_HARDEN_MODEL_PROFILE", "model-ci"))
MIXED = (RequestSpec(2), RequestSpec(1), RequestSpec(3), RequestSpec(3, auto_truncate=True))


def machine_for(policy: str, specs: tuple[RequestSpec, ...], **extra: object) -> type[RuleBasedStateMachine]:
    config = build_config(specs=specs, pages=3, **extra)

    class HandoffMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.model = Model(config, make_policy(policy, config))
            self.state = self.model.initial()
            self.trace: list[str] = []

        def _fail(self, what: str) -> str:
            return f"{policy}: {what}\n" + "\n".join(f"  {i:2d}. {t}" for i, t in enumerate(self.trace, 1))

        def _apply(self, event: tuple[str, int]) -> None:
            self.state, violations, note = self.model.step(self.state, event)
            self.trace.append(f"{event[0]} r{event[1]}: {note}")
            assert not violations, self._fail("; ".join(f"{v.prop}: {v.detail}" for v in violations))

        @rule(data=st.data())
        def step(self, data: st.DataObject) -> None:
            events = self.model.enabled(self.state)
            if events:
                self._apply(data.draw(st.sampled_from(events), label="event"))

        @invariant()
        def nothing_waits_for_a_timeout(self) -> None:
            violation = self.model.check_state(self.state, self.model.enabled(self.state))
            assert violation is None, self._fail(f"{violation.prop}: {violation.detail}")

        def teardown(self) -> None:
            """Let the system run to quiesce without clients, timeouts or failures, then check for leaks."""
            for _ in range(400):
                events = self.model.enabled(self.state)
                progress = [event for event in events if event[0] not in EXTERNAL]
                if not progress:
                    break
                self._apply(progress[0])
            events = self.model.enabled(self.state)
            violation = self.model.check_state(self.state, events)
            assert violation is None, self._fail(f"{violation.prop}: {violation.detail}")

    return HandoffMachine


def test_hardened_random_walks_find_nothing():
    run_state_machine_as_test(machine_for("hardened", MIXED), settings=PROFILE)


def test_hardened_with_page_table_faults_finds_nothing():
    machine = machine_for("hardened", MIXED[:2], faults=frozenset({"misowned_page"}))
    run_state_machine_as_test(machine, settings=PROFILE)


def test_vanilla_random_walks_hit_the_incident():
    one_bug = settings(PROFILE, report_multiple_bugs=False)
    with pytest.raises(AssertionError, match="rejected_allocated|stale_read|unwritten_read"):
        run_state_machine_as_test(machine_for("vanilla", INCIDENT_REQUESTS), settings=one_bug)
