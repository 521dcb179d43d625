#!/usr/bin/env python3
"""Per-request cost of the page ledger + page tags on the real CPU PD pair: vanilla vs hardened.

Runs two pairs of one pin (tiny model, Mooncake TCP or NIXL on loopback), one at a time (on this 2-core machine
idle SGLang servers poll busily, so pairs running side by side slow each other down):

* ``vanilla``  - ``sglang.launch_server``;
* ``hardened`` - ``sglang_harden.launch_server`` with every guard on except the digest
  (``SGLANG_HARDEN_CHECKSUM=off``, so its cost, measured by ``bench_digest_pd.py``, does not mix in), and
  ``SGLANG_HARDEN_TIME_HOOKS=lifecycle,page_tags``.

and sends the same greedy requests to each, discarding warm-up requests. Reports per-request end-to-end latency
medians and minima and ``hardened / vanilla``. Goal (issue 5): the per-transfer overhead of the page ledger +
page tags <= 1.01x. ``--passes 2`` runs the variants twice, in reverse order the second time.

End-to-end medians of separate pairs differ by a few percent from pair to pair, more than the ledger costs. So
the hardened servers time their lifecycle and page_tags hooks (``sglang_harden.compat.hook_timer``: per hook,
the wrapper's time minus the time spent in SGLang's own function) and report the totals on ``/server_info``
(``internal_states[*].sglang_harden.hook_time``). The warm-up requests (and start-up: ``Scheduler.__init__``
is a lifecycle hook) pass the hooks too, so the totals of both servers are read after the warm-ups and again
after the measured requests; the difference over the measured requests is the hook time per request, and
``ratio_in_server`` = hardened median / (hardened median - hook time per request).

The hook time is an upper bound of what the hooks add to latency: it includes hooks off the request's path
(prefill's transfer threads), and the hooks on the scheduler loop (``LOOP_HOOKS``: ``pop_transferred``,
``process_disagg_prefill_inflight_queue``, the idle pool check) run on every iteration, idle spins included,
so their share grows with wall time, not with transfers. ``transfer_hook_us_per_request`` and
``ratio_in_server_transfer`` leave those out; ``hook_per_request`` (calls and microseconds per request, per
role and hook) shows every hook. The timer itself counts a fraction of a microsecond per call.

    python3 scripts/bench_ledger_pd.py --pin 0.5.19 --json
    python3 scripts/bench_ledger_pd.py --pin 0.5.23 --backend nixl --json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_harden.compat.hook_timer import ENV as TIME_HOOKS_ENV  # noqa: E402
from sglang_harden.testbed import pdbench  # noqa: E402
from sglang_harden.testbed.pd_topology import PDPair  # noqa: E402
from sglang_harden.testbed.server import HARDENED_LAUNCHER, VANILLA_LAUNCHER  # noqa: E402

HARDENED_ENV = {"SGLANG_HARDEN_ACTIVATE": "1", "SGLANG_HARDEN_CHECKSUM": "off", TIME_HOOKS_ENV: "lifecycle,page_tags"}
LOOP_HOOKS = ("._check_pool_invariant#", ".process_disagg_prefill_inflight_queue#", ".pop_transferred#")
VARIANTS = {"vanilla": (VANILLA_LAUNCHER, {}), "hardened": (HARDENED_LAUNCHER, HARDENED_ENV)}
HookTotals = tuple[Counter[str], Counter[str]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return pdbench.parser(__doc__.splitlines()[0], "measured requests per variant and pass").parse_args(argv)


def hook_totals(pair: PDPair) -> HookTotals:
    """Calls and microseconds of every timed hook so far, keyed ``"<role> <target>#<owner>"``, both servers."""
    calls: Counter[str] = Counter()
    micros: Counter[str] = Counter()
    for server in (pair.prefill, pair.decode):
        for state in server.server_info().get("internal_states") or []:
            harden = (state or {}).get("sglang_harden") or {}
            for key, stats in (harden.get("hook_time") or {}).items():
                calls[f"{harden.get('role')} {key}"] += stats["count"]
                micros[f"{harden.get('role')} {key}"] += stats["total_us"]
    return calls, micros


def run_variant(args: argparse.Namespace, variant: str, log_dir: Path) -> tuple[list[float], HookTotals]:
    """Measured latencies and, for ``hardened``, the hook totals the measured requests added."""
    launcher, env = VARIANTS[variant]
    pair = pdbench.make_pair(args, launcher, env, log_dir / variant).start()  # a failed start stops what it started
    try:
        pdbench.send(pair, variant, args, 0, args.warmup)
        timed = variant == "hardened"
        before = hook_totals(pair) if timed else (Counter(), Counter())
        times = pdbench.send(pair, variant, args, args.warmup, args.requests)
        after = hook_totals(pair) if timed else (Counter(), Counter())
    finally:
        pair.stop()
    if timed and {key.split()[0] for key in after[0]} != {"prefill", "decode"}:
        raise RuntimeError(f"prefill and decode must both report hook_time, got {sorted(after[0])}")
    return times, (after[0] - before[0], after[1] - before[1])


def measure(args: argparse.Namespace, log_root: Path) -> tuple[dict[str, list[float]], HookTotals]:
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    calls: Counter[str] = Counter()
    micros: Counter[str] = Counter()
    order = list(VARIANTS)
    for n in range(args.passes):
        for variant in order if n % 2 == 0 else order[::-1]:
            print(f"[bench-ledger-pd] pass {n + 1}: {variant} (logs {log_root / f'pass{n + 1}'})", file=sys.stderr)
            measured, (c, us) = run_variant(args, variant, log_root / f"pass{n + 1}")
            times[variant] += measured
            calls.update(c)
            micros.update(us)
    return times, (calls, micros)


def report(measured: tuple[dict[str, list[float]], HookTotals], args: argparse.Namespace) -> dict[str, object]:
    times, (calls, micros) = measured
    requests = len(times["hardened"])
    med = {name: statistics.median(t) for name, t in times.items()}
    low = {name: min(t) for name, t in times.items()}
    added_s = sum(micros.values()) / 1e6 / requests
    per_transfer_s = sum(us for key, us in micros.items() if not any(h in key for h in LOOP_HOOKS)) / 1e6 / requests
    return {
        **pdbench.run_summary(args, times),
        "ratio_median": round(med["hardened"] / med["vanilla"], 4),
        "ratio_min": round(low["hardened"] / low["vanilla"], 4),
        "hook_per_request": {
            key: {"calls": round(calls[key] / requests, 1), "us": round(micros[key] / requests, 1)}
            for key in sorted(micros, key=micros.__getitem__, reverse=True)
        },
        "hook_calls_per_request": round(sum(calls.values()) / requests, 1),
        "hook_us_per_request": round(added_s * 1e6, 1),
        "ratio_in_server": round(med["hardened"] / (med["hardened"] - added_s), 4),
        "transfer_hook_us_per_request": round(per_transfer_s * 1e6, 1),
        "ratio_in_server_transfer": round(med["hardened"] / (med["hardened"] - per_transfer_s), 4),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return pdbench.main(args, "sglang-harden-bench-ledger-", lambda log_root: report(measure(args, log_root), args))


if __name__ == "__main__":
    raise SystemExit(main())
