"""Statistics of an interleaved A/B benchmark (``scripts/bench_guards.py``): per-round ratios, a seeded bootstrap
confidence interval of their mean, and the verdict against a resolution (1 % by default).

Each round measures A (vanilla) and B (a variant) back to back on the same requests, so drift of the machine
(other load, thermal, cache state) mostly cancels in the round's ratio B / A; the rounds are then the independent
samples. The interval is the percentile bootstrap of the mean ratio over the rounds (resampled with replacement).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

DEFAULT_RESAMPLES = 2000
DEFAULT_SEED = 0
DEFAULT_LEVEL = 0.95


def ratios(baseline: Sequence[float], variant: Sequence[float]) -> list[float]:
    """Per-round ``variant / baseline`` (the two sequences are the same rounds, in order)."""
    if len(baseline) != len(variant):
        raise ValueError(f"{len(baseline)} baseline rounds vs {len(variant)} variant rounds")
    if any(a <= 0 for a in baseline):
        raise ValueError(f"a baseline value is not positive: {list(baseline)}")
    return [b / a for a, b in zip(baseline, variant, strict=True)]


def bootstrap_mean_ci(
    values: Sequence[float],
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
    level: float = DEFAULT_LEVEL,
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values``: ``resamples`` resamples of the rounds with
    replacement from a generator seeded with ``seed`` (the same inputs give the same interval)."""
    if len(values) < 2:
        raise ValueError(f"a bootstrap interval needs at least 2 rounds, got {len(values)}")
    if resamples < 1 or not 0.0 < level < 1.0:
        raise ValueError(f"resamples={resamples}, level={level}")
    data = np.asarray(values, dtype=float)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(data), size=(resamples, len(data)))
    means = data[picks].mean(axis=1)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return float(low), float(high)


@dataclass(frozen=True)
class RatioSummary:
    """The mean of per-round ratios and its bootstrap interval."""

    rounds: int
    mean: float
    ci_low: float
    ci_high: float
    stdev: float

    def as_json(self) -> dict[str, Any]:
        return {key: round(value, 5) if isinstance(value, float) else value for key, value in asdict(self).items()}


def summarize(
    values: Sequence[float],
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = DEFAULT_SEED,
    level: float = DEFAULT_LEVEL,
) -> RatioSummary:
    low, high = bootstrap_mean_ci(values, resamples, seed, level)
    data = np.asarray(values, dtype=float)
    return RatioSummary(len(values), float(data.mean()), low, high, float(data.std(ddof=1)))


def rounds_for_resolution(stdev: float, resolution: float = 0.01, z: float = 1.96) -> int:
    """About how many rounds the 95 % interval of the mean needs to be no wider than +-``resolution``, given the
    per-round ratios' standard deviation (normal approximation: half-width = z * stdev / sqrt(rounds))."""
    if resolution <= 0:
        raise ValueError(f"resolution {resolution} must be positive")
    return max(2, math.ceil((z * stdev / resolution) ** 2))


@dataclass(frozen=True)
class Verdict:
    """What a throughput-ratio interval says against the resolution (higher ratio = faster variant)."""

    includes_one: bool
    above_threshold: bool  # the whole interval lies above 1 - resolution: any cost is below the resolution
    below_threshold: bool  # the whole interval lies below 1 - resolution: the cost exceeds the resolution
    text: str


def verdict(low: float, high: float, resolution: float = 0.01) -> Verdict:
    """Classify a throughput-ratio interval ``[low, high]``: within the resolution (lies above ``1 - resolution``),
    costs more (lies below it), or unresolved (straddles it); says whether it includes 1.00."""
    if low > high:
        raise ValueError(f"interval [{low}, {high}] is reversed")
    threshold = 1.0 - resolution
    includes_one = low <= 1.0 <= high
    above, below = low >= threshold, high < threshold
    pct = f"{resolution * 100:g} %"
    if above and includes_one:
        text = f"cost < {pct} (CI includes 1.00, lies above {threshold:.2f})"
    elif above and low > 1.0:
        text = "no cost (CI lies above 1.00)"
    elif above:
        text = f"cost < {pct} (CI lies above {threshold:.2f}, excludes 1.00)"
    elif below:
        text = f"cost > {pct} (CI lies below {threshold:.2f})"
    else:
        text = f"unresolved at {pct} (CI includes {threshold:.2f})"
    return Verdict(includes_one, above, below, text)


def markdown_table(rows: Sequence[dict[str, Any]], header_lines: Sequence[str] = ()) -> str:
    """The report's table: one row per variant (keys: variant, rounds, mean, ci_low, ci_high, verdict, latency
    (mean, ci_low, ci_high), rounds_needed, other_cores, runtime_s; or variant and error)."""
    lines = [*header_lines, *([""] if header_lines else []),
             "| variant | rounds | throughput ratio (mean) | 95 % CI low | 95 % CI high | verdict "
             "| p50 latency ratio (mean, 95 % CI) | rounds for +-1 % | other load (cores) | runtime s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if row.get("error"):
            lines.append(f"| {row['variant']} | - | - | - | - | {row['error']} | - | - | - | - |")
            continue
        lat = row["latency"]
        lines.append(
            f"| {row['variant']} | {row['rounds']} | {row['mean']:.4f} | {row['ci_low']:.4f} | {row['ci_high']:.4f} "
            f"| {row['verdict']} | {lat[0]:.4f} [{lat[1]:.4f}, {lat[2]:.4f}] | {row['rounds_needed']} "
            f"| {row['other_cores']:.2f} | {row['runtime_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"
