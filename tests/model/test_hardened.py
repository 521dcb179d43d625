"""Hardened: no violation anywhere the explorer can reach."""

import pytest

from sglang_harden.protocol.explorer import check_policy
from sglang_harden.protocol.policies import ConfigRefused, make_policy
from sglang_harden.protocol.scenarios import INCIDENT_REQUESTS, TRUNCATE_REQUESTS, build_config
from sglang_harden.protocol.world import RequestSpec


def check(*args, **kwargs):
    result = check_policy(*args, **kwargs)
    print(result.summary())
    for counterexample in result.counterexamples.values():
        print(counterexample.format())
    return result


def test_hardened_explores_over_100k_states_without_violation():
    """Two requests that share pages, every client event, timeout and transfer failure: all reachable states."""
    config = build_config(specs=(RequestSpec(2), RequestSpec(1)), pages=3)
    result = check("hardened", config, depth=60)
    print(f"hardened: {result.states:,} distinct states explored")
    assert result.states >= 100_000
    assert result.exhausted
    assert not result.counterexamples


@pytest.mark.parametrize("specs", [INCIDENT_REQUESTS, TRUNCATE_REQUESTS], ids=["incident", "truncate"])
def test_hardened_incident_and_truncate_scenarios_are_clean(specs):
    result = check("hardened", build_config(specs=specs, pages=3), depth=60)
    assert result.exhausted and not result.counterexamples


def test_hardened_rejects_b_with_its_own_400():
    config = build_config(specs=INCIDENT_REQUESTS, pages=3, client_events=False, timeouts=False)
    result = check("hardened", config, depth=60)
    assert result.exhausted and not result.counterexamples


def test_capacity_gate_refuses_or_clamps_the_incident_pools():
    config = build_config(specs=INCIDENT_REQUESTS, pages=3, capacity_mode="enforce")
    with pytest.raises(ConfigRefused, match="--harden-capacity clamp"):
        make_policy("hardened", config)
    clamped = make_policy("hardened", build_config(specs=INCIDENT_REQUESTS, pages=3, capacity_mode="clamp"))
    assert clamped.context_len() == 2
