"""Turn each hardened guard off in turn: a counterexample, or a recorded reason why the model cannot show one."""

import pytest

from sglang_harden.protocol.explorer import check_policy
from sglang_harden.protocol.policies import LIFECYCLE_RULES, MODELLED_GUARDS, UNMODELLED_GUARDS
from sglang_harden.protocol.scenarios import INCIDENT_REQUESTS, TRUNCATE_REQUESTS, build_config
from sglang_harden.protocol.world import RequestSpec


def check(*args, **kwargs):
    result = check_policy(*args, **kwargs)
    print(result.summary())
    for counterexample in result.counterexamples.values():
        print(counterexample.format())
    return result


SHARED = (RequestSpec(2), RequestSpec(1))  # r1 reuses r0's pages

# guard -> (request script, extra config, property whose counterexample must appear)
BREAKS = {
    "admission": (INCIDENT_REQUESTS, {}, "rejected_allocated"),
    "abort_notify": (INCIDENT_REQUESTS, {}, "stuck_until_timeout"),
    "lifecycle": (SHARED, {}, "late_write_read"),
    "lifecycle.quarantine": (SHARED, {}, "late_write_read"),
    "lifecycle.source_hold": (SHARED, {}, "source_reuse_read"),
    "page_tags": (SHARED, {"faults": frozenset({"misowned_page"})}, "unwritten_read"),
    "coverage+page_tags": (TRUNCATE_REQUESTS, {}, "unwritten_read"),
}

# guard -> why the model shows no counterexample with only that guard off (checked below: none appears)
DEFENCE_IN_DEPTH = {
    "retire": "every pending rejection is already stopped at the prefill door (admission); with admission "
    "off too, retire refuses the stub's final send, and an abort between forward and send is caught after "
    "the send by the source hold and the abort notice. Its own invariant (no final KV send for an ended "
    "request) is not a separate model property.",
    "coverage": "a short send leaves pages WRITING in the ledger, so the page-tag check aborts the request "
    "before its first step (coverage+page_tags together do break: see BREAKS)",
    "capacity": "the model runs the gate in log mode (as the demo does) so that the request-path guards are "
    "exercised; the gate removes the precondition (pool smaller than the advertised context), which "
    "test_hardened checks separately in enforce and clamp modes",
    "lifecycle.window": "bounds how many writes can still land after a failure, i.e. how long a drain wait "
    "lasts; the model has no clock and quarantine already makes every late write harmless",
    "lifecycle.cap": "bounds quarantine (503 instead of unbounded growth); a resource/liveness limit, not a "
    "safety property the model expresses",
}
DEFENCE_SCENARIO = {
    "retire": (INCIDENT_REQUESTS, 60),
    "coverage": (TRUNCATE_REQUESTS, 60),
    "capacity": (INCIDENT_REQUESTS, 60),
    "lifecycle.window": (SHARED, 9),
    "lifecycle.cap": (SHARED, 9),
}


def test_every_guard_is_accounted_for():
    single = {name for name in BREAKS if "+" not in name} | set(DEFENCE_IN_DEPTH) | set(UNMODELLED_GUARDS)
    assert single == set(MODELLED_GUARDS) | set(LIFECYCLE_RULES) | set(UNMODELLED_GUARDS)


@pytest.mark.parametrize("name", sorted(BREAKS))
def test_disabling_guard_breaks_a_property(name):
    specs, extra, prop = BREAKS[name]
    config = build_config(specs=specs, pages=3, **extra)
    result = check("hardened", config, disabled=name.split("+"), stop_when=[prop], stop_at_first=False)
    assert prop in result.counterexamples, result.summary()


@pytest.mark.parametrize("name", sorted(DEFENCE_IN_DEPTH))
def test_defence_in_depth_guard_alone_shows_no_violation(name):
    specs, depth = DEFENCE_SCENARIO[name]
    result = check("hardened", build_config(specs=specs, pages=3), disabled=[name], depth=depth)
    assert not result.counterexamples, DEFENCE_IN_DEPTH[name]


def test_unmodelled_guards_say_why():
    for guard, why in UNMODELLED_GUARDS.items():
        assert len(why) > 40, guard
