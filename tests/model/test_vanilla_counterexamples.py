"""Vanilla (upstream <= 0.5.19) must show the incident and the late-write race."""

from sglang_harden.protocol.explorer import check_policy
from sglang_harden.protocol.scenarios import INCIDENT_REQUESTS, build_config
from sglang_harden.protocol.world import RequestSpec


def check(*args, **kwargs):
    result = check_policy(*args, **kwargs)
    print(result.summary())
    for counterexample in result.counterexamples.values():
        print(counterexample.format())
    return result


def test_incident_oversized_stub_reads_stale_kv_without_any_fault():
    """No aborts, no timeouts, no failures: A completes, B (too long for prefill) reads A's KV."""
    config = build_config(specs=INCIDENT_REQUESTS, pages=3, client_events=False, timeouts=False)
    result = check("vanilla", config, stop_when=["stale_read"], stop_at_first=False)
    stale = result.counterexamples["stale_read"]
    kinds = [kind for kind, _ in stale.events]
    assert not {"client_abort", "prefill_disconnect", "transfer_fail", "decode_timeout"} & set(kinds)
    assert "r1 read decode page" in stale.detail and "r0's KV" in stale.detail
    assert any("stubs it" in note for note in stale.notes)
    assert "completes (HTTP 200)" in stale.notes[-1]
    assert "rejected_completed" in result.counterexamples  # B's client got 200, not its 400
    assert "rejected_allocated" in result.counterexamples


def test_late_write_race_lands_in_next_owners_page():
    config = build_config(specs=(RequestSpec(2), RequestSpec(1)), pages=3)
    result = check("vanilla", config, stop_when=["late_write_read"], stop_at_first=False)
    race = result.counterexamples["late_write_read"]
    assert any("LATE" in note for note in race.notes)
    assert race.events[-1] == ("decode_step", 1)


def test_vanilla_decode_waits_for_timeout_after_prefill_gives_up():
    config = build_config(specs=INCIDENT_REQUESTS, pages=3)
    result = check("vanilla", config, stop_when=["stuck_until_timeout"], stop_at_first=False)
    assert "decode_timeout" in result.counterexamples["stuck_until_timeout"].detail


def test_counterexample_trace_is_short_and_readable():
    config = build_config(specs=INCIDENT_REQUESTS, pages=3, client_events=False, timeouts=False)
    text = check("vanilla", config).first.format()
    lines = text.splitlines()
    assert lines[0].startswith("counterexample: ") and len(lines) < 25
    assert "submit r1: prompt 3; prefill stubs it" in text
