"""The guard benchmark's statistics (sglang_harden/testbed/benchstats.py) on synthetic rounds."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_harden.testbed import benchstats


def _rounds(true_ratio: float, n: int, noise: float, seed: int) -> tuple[list[float], list[float]]:
    """Vanilla throughput per round drifting by +-20 %, the variant at ``true_ratio`` of it with ``noise``."""
    rng = np.random.default_rng(seed)
    vanilla = 100.0 * (1.0 + 0.2 * rng.uniform(-1, 1, n))
    variant = vanilla * true_ratio * (1.0 + rng.normal(0.0, noise, n))
    return list(vanilla), list(variant)


def test_ratios_are_variant_over_baseline_per_round() -> None:
    assert benchstats.ratios([100.0, 50.0], [99.0, 51.0]) == [0.99, 1.02]
    with pytest.raises(ValueError, match="rounds"):
        benchstats.ratios([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="not positive"):
        benchstats.ratios([0.0], [1.0])


def test_a_known_ratio_is_recovered_despite_drift() -> None:
    vanilla, variant = _rounds(0.97, 12, 0.01, seed=1)
    summary = benchstats.summarize(benchstats.ratios(vanilla, variant))
    assert summary.rounds == 12
    assert summary.mean == pytest.approx(0.97, abs=0.01)
    assert summary.ci_low < 0.97 < summary.ci_high
    assert summary.ci_high - summary.ci_low < 0.02, "the drift cancels in the per-round ratio"


def test_the_interval_shrinks_with_rounds() -> None:
    widths = []
    for n in (10, 40, 160):
        vanilla, variant = _rounds(1.0, n, 0.03, seed=7)
        low, high = benchstats.bootstrap_mean_ci(benchstats.ratios(vanilla, variant))
        widths.append(high - low)
    assert widths[0] > widths[1] > widths[2]
    assert widths[2] < widths[0] / 2.5, widths  # about 1/sqrt(rounds): 4x the rounds, half the width


def test_the_bootstrap_is_seeded() -> None:
    values = [0.98, 1.01, 0.99, 1.02, 0.97, 1.0, 0.995, 1.005, 0.99, 1.01]
    assert benchstats.bootstrap_mean_ci(values, seed=3) == benchstats.bootstrap_mean_ci(values, seed=3)
    assert benchstats.bootstrap_mean_ci(values, seed=3) != benchstats.bootstrap_mean_ci(values, seed=4)
    low, high = benchstats.bootstrap_mean_ci(values, resamples=2000)
    assert min(values) <= low <= float(np.mean(values)) <= high <= max(values)


def test_the_bootstrap_refuses_too_few_rounds() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        benchstats.bootstrap_mean_ci([1.0])


@pytest.mark.parametrize(("low", "high", "includes_one", "above", "below", "starts"), [
    (0.995, 1.004, True, True, False, "cost < 1 % (CI includes 1.00"),
    (0.991, 0.998, False, True, False, "cost < 1 % (CI lies above 0.99, excludes 1.00)"),
    (1.002, 1.010, False, True, False, "no cost"),
    (0.970, 0.985, False, False, True, "cost > 1 %"),
    (0.980, 1.010, True, False, False, "unresolved at 1 %"),
])
def test_verdicts(low: float, high: float, includes_one: bool, above: bool, below: bool, starts: str) -> None:
    v = benchstats.verdict(low, high, resolution=0.01)
    assert (v.includes_one, v.above_threshold, v.below_threshold) == (includes_one, above, below)
    assert v.text.startswith(starts), v.text


def test_markdown_table_has_a_row_per_variant_and_failures() -> None:
    rows = [{"variant": "all", "rounds": 12, "mean": 0.995, "ci_low": 0.99, "ci_high": 1.0, "verdict": "v",
             "latency": (1.01, 1.0, 1.02), "rounds_needed": 40, "other_cores": 0.123, "runtime_s": 150.0},
            {"variant": "canary", "error": "failed: did not start"}]
    text = benchstats.markdown_table(rows, ["Command: `x`"])
    lines = text.splitlines()
    assert lines[0] == "Command: `x`" and lines[1] == "" and lines[2].startswith("| variant |")
    assert "| all | 12 | 0.9950 | 0.9900 | 1.0000 | v | 1.0100 [1.0000, 1.0200] | 40 | 0.12 | 150 |" in lines
    assert "| canary | - | - | - | - | failed: did not start | - | - | - | - |" in lines


def test_rounds_for_resolution() -> None:
    assert benchstats.rounds_for_resolution(0.017, 0.01) == 12  # (1.96 * 0.017 / 0.01) ** 2 = 11.1
    assert benchstats.rounds_for_resolution(0.10, 0.01) == 385
    assert benchstats.rounds_for_resolution(0.0, 0.01) == 2
    vanilla, variant = _rounds(1.0, 400, 0.05, seed=2)
    values = benchstats.ratios(vanilla, variant)
    n = benchstats.rounds_for_resolution(benchstats.summarize(values).stdev, 0.01)
    low, high = benchstats.bootstrap_mean_ci(values[:n])
    assert (high - low) / 2 == pytest.approx(0.01, rel=0.25), "that many rounds give about +-1 %"
