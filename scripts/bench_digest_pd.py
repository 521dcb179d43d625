#!/usr/bin/env python3
"""Per-request cost of the KV digest on the real CPU PD pair: vanilla, hardened without and with the digest.

Runs three pairs of one pin (tiny model, Mooncake TCP on loopback), one at a time (on this 2-core machine
idle SGLang servers poll busily, so pairs running side by side slow each other down tenfold):

* ``vanilla``   - ``sglang.launch_server``;
* ``no_digest`` - ``sglang_harden.launch_server`` with ``--harden-checksum off`` (every other guard on);
* ``hardened``  - ``sglang_harden.launch_server`` with every guard on, the digest included.

and sends the same greedy requests to each, discarding warm-up requests. Reports per-request end-to-end
latency medians and minima and the ratios ``hardened / vanilla`` and ``hardened / no_digest`` (the digest
alone). Goal (issue 7): the per-request overhead of the digest <= 1.02x. ``--passes 2`` runs the variants
twice, in reverse order the second time, so slow drift shows up as a difference between passes.

End-to-end medians of separate server pairs differ by a few percent from pair to pair on this machine, more
than the digest costs. So the hardened servers also report the time the digest itself added inside them
(``/server_info``: prefill's digest + publish, decode's fetch + recompute + compare, per request), and the
script reports ``ratio_in_server`` = hardened median / (hardened median - digest time per request): the
same ratio, with the noise of separate pairs taken out.

    python3 scripts/bench_digest_pd.py --pin 0.5.19 --json

Run it on a quiet machine: with other servers running, the medians carry their noise. On a 2-core machine
every idle SGLang scheduler spins on a core, so each HTTP answer the digest waits for (prefill's publish,
decode's query) first waits for a CPU; ``--server-flag=--sleep-on-idle`` (given to every server of every
variant) measures the same pairs without that contention.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_harden.testbed import pdbench  # noqa: E402
from sglang_harden.testbed.pd_topology import PDPair  # noqa: E402
from sglang_harden.testbed.server import HARDENED_LAUNCHER, VANILLA_LAUNCHER  # noqa: E402

VARIANTS = {
    "vanilla": (VANILLA_LAUNCHER, {}),
    "no_digest": (HARDENED_LAUNCHER, {"SGLANG_HARDEN_ACTIVATE": "1", "SGLANG_HARDEN_CHECKSUM": "off"}),
    "hardened": (HARDENED_LAUNCHER, {"SGLANG_HARDEN_ACTIVATE": "1"}),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return pdbench.parser(__doc__.splitlines()[0], "measured requests per variant").parse_args(argv)


def start(args: argparse.Namespace, variant: str, log_dir: Path) -> PDPair:
    launcher, env = VARIANTS[variant]
    return pdbench.make_pair(args, launcher, env, log_dir / variant).start()


def measure_one(pair: PDPair, name: str, args: argparse.Namespace) -> list[float]:
    return pdbench.send(pair, name, args, 0, args.warmup + args.requests)[args.warmup:]


def digest_time(pair: PDPair) -> dict[str, dict[str, float]]:
    """What the digest cost inside the hardened servers: ``{"publish": {...}, "verify": {...}}``."""
    found: dict[str, dict[str, float]] = {}
    for server in (pair.prefill, pair.decode):
        for state in server.server_info().get("internal_states") or []:
            found.update(((state or {}).get("sglang_harden") or {}).get("digest_time") or {})
    return found


def measure(args: argparse.Namespace, log_root: Path) -> tuple[dict[str, list[float]], list[dict]]:
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    in_server: list[dict] = []
    order = list(VARIANTS)
    for n in range(args.passes):
        for variant in order if n % 2 == 0 else order[::-1]:
            print(f"[bench-digest-pd] pass {n + 1}: {variant} (logs {log_root / variant})", file=sys.stderr)
            pair = start(args, variant, log_root / f"pass{n + 1}")
            try:
                times[variant] += measure_one(pair, variant, args)
                if variant == "hardened":
                    in_server.append(digest_time(pair))
            finally:
                pair.stop()
    return times, in_server


def added_per_request_s(in_server: list[dict]) -> float:
    """Mean digest time per request (prefill publish + decode verify), over every hardened pass."""
    total = count = 0.0
    for stats in in_server:
        for what in ("publish", "verify"):
            if what not in stats:
                raise RuntimeError(f"hardened servers reported no digest {what} time: {stats}")
        total += sum(stats[w]["mean_us"] * stats[w]["count"] for w in ("publish", "verify")) / 1e6
        count += stats["verify"]["count"]
    return total / count


def report(measured: tuple[dict[str, list[float]], list[dict]], args: argparse.Namespace) -> dict[str, object]:
    times, in_server = measured
    med = {name: statistics.median(t) for name, t in times.items()}
    low = {name: min(t) for name, t in times.items()}
    added = added_per_request_s(in_server)
    return {
        **pdbench.run_summary(args, times),
        "ratio_median": {
            "hardened/vanilla": round(med["hardened"] / med["vanilla"], 4),
            "hardened/no_digest": round(med["hardened"] / med["no_digest"], 4),
        },
        "ratio_min": {
            "hardened/vanilla": round(low["hardened"] / low["vanilla"], 4),
            "hardened/no_digest": round(low["hardened"] / low["no_digest"], 4),
        },
        "digest_in_server": in_server,
        "digest_us_per_request": round(added * 1e6, 1),
        "ratio_in_server": round(med["hardened"] / (med["hardened"] - added), 4),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return pdbench.main(args, "sglang-harden-bench-digest-", lambda log_root: report(measure(args, log_root), args))


if __name__ == "__main__":
    raise SystemExit(main())
