"""A tallied ALLOW reaches the real Prometheus counter without anyone asking for a snapshot (the fold thread).

Runs where prometheus_client is installed (a pin venv: ``scripts/run_tests.sh`` runs it there)."""

from __future__ import annotations

import time

import pytest

from sglang_harden import events
from sglang_harden.config import Mode
from sglang_harden.guards.base import Decision, Verdict, allow

prometheus_client = pytest.importorskip("prometheus_client")


def _sample(guard: str, decision: str, mode: str = "enforce") -> float:
    value = prometheus_client.REGISTRY.get_sample_value(
        events.METRIC_NAME + "_total", {"guard": guard, "decision": decision, "mode": mode}
    )
    return value or 0.0


def test_fold_thread_moves_tallies_into_the_prometheus_counter() -> None:
    tally = events.Tally(allow("prom_probe"))
    before = _sample("prom_probe", "allow")
    for room in range(3):
        tally.bump(Mode.ENFORCE, room=room)
    deadline = time.monotonic() + 10 * events.FLUSH_INTERVAL_S
    while _sample("prom_probe", "allow") < before + 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _sample("prom_probe", "allow") == before + 3


def test_recorded_and_tallied_allows_share_one_counter() -> None:
    tally = events.Tally(allow("prom_mix"))
    tally.bump(Mode.ENFORCE)
    events.record(allow("prom_mix"), Mode.ENFORCE)
    events.snapshot()
    assert _sample("prom_mix", "allow") == 2


def test_build_info_names_the_version_pin_and_mode() -> None:
    labels = {"version": "9.9.9", "pin": "0.5.23", "family": "sglang-0.5.19+", "role": "scheduler/decode",
              "mode": "log"}
    events.publish_build_info(**labels)
    events.publish_build_info(**{**labels, "role": "scheduler/prefill"})
    for role in ("scheduler/decode", "scheduler/prefill"):
        assert prometheus_client.REGISTRY.get_sample_value(events.BUILD_INFO_NAME, {**labels, "role": role}) == 1


def test_mode_is_its_own_label_for_recorded_and_tallied_decisions() -> None:
    tally = events.Tally(allow("prom_modes"))
    tally.bump(Mode.ENFORCE)
    tally.bump(Mode.LOG)
    tally.bump(Mode.LOG)
    events.record(Decision("prom_modes", Verdict.REJECT, "test"), Mode.LOG, quiet=True)
    events.record(Decision("prom_modes", Verdict.REJECT, "test"), Mode.ENFORCE, quiet=True)
    assert events.snapshot()["prom_modes:allow"] == 3
    assert (_sample("prom_modes", "allow", "enforce"), _sample("prom_modes", "allow", "log")) == (1, 2)
    assert _sample("prom_modes", "reject_logged", "log") == 1
    assert _sample("prom_modes", "reject", "enforce") == 1
    assert _sample("prom_modes", "reject", "log") == 0


def test_primed_decisions_exist_at_zero_before_they_happen() -> None:
    events.prime(Decision("prom_prime", Verdict.ABORT), Mode.ENFORCE)
    events.prime(Decision("prom_prime_log", Verdict.REJECT), Mode.LOG)
    events.prime(Decision("prom_prime_off", Verdict.ABORT), Mode.OFF)
    registry = prometheus_client.REGISTRY
    assert registry.get_sample_value(events.METRIC_NAME + "_total",
                                     {"guard": "prom_prime", "decision": "abort", "mode": "enforce"}) == 0
    assert registry.get_sample_value(events.METRIC_NAME + "_total",
                                     {"guard": "prom_prime_log", "decision": "reject_logged", "mode": "log"}) == 0
    assert registry.get_sample_value(events.METRIC_NAME + "_total",
                                     {"guard": "prom_prime_off", "decision": "abort", "mode": "off"}) is None
    events.record(Decision("prom_prime", Verdict.ABORT, "test"), Mode.ENFORCE, quiet=True)
    assert _sample("prom_prime", "abort") == 1


def test_start_up_primes_the_watched_decisions_of_armed_guards() -> None:
    """What the alert rules watch starts at 0 on /metrics for each armed guard, in its mode; nothing for a guard
    that is not armed or not watched."""
    from sglang_harden.compat.runtime import WATCHED_DECISIONS, Runtime
    from sglang_harden.config import HardenConfig

    registry = prometheus_client.REGISTRY
    admission = {"guard": "admission", "decision": "reject", "mode": "enforce"}
    admission_before = registry.get_sample_value(events.METRIC_NAME + "_total", admission)
    runtime = Runtime(config=HardenConfig(bootstrap_auth=Mode.LOG), pin="0.5.23", family="test",
                      armed=("checksum", "bootstrap_auth", "admission"))
    runtime.log_active(role="scheduler/prime-test")
    assert set(WATCHED_DECISIONS) >= {"checksum", "bootstrap_auth"} and "admission" not in WATCHED_DECISIONS
    assert registry.get_sample_value(events.METRIC_NAME + "_total",
                                     {"guard": "checksum", "decision": "abort", "mode": "enforce"}) is not None
    logged = {"guard": "bootstrap_auth", "decision": "reject_logged", "mode": "log"}
    assert registry.get_sample_value(events.METRIC_NAME + "_total", logged) is not None
    assert registry.get_sample_value(events.METRIC_NAME + "_total", admission) == admission_before
