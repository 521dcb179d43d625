#!/usr/bin/env python3
"""What each guard costs on the real CPU PD pair: an interleaved A/B benchmark against vanilla, with a bootstrap
confidence interval per variant, built to resolve a 1 % difference in throughput.

One vanilla pair (A: ``sglang.launch_server``, plugin off) stays up for the whole run. For each variant (B:
``all`` = every guard on, ``<guard>`` = that guard alone, see ``sglang_harden/testbed/guardbench.py``) the script
starts the variant's pair (same pin, profile, pool sizes and server flags; only the launcher and the
``SGLANG_HARDEN_*`` environment differ), checks from the schedulers' start-up lines that exactly the variant's
guards are armed, runs one warm-up round (discarded) and ``--rounds`` measured rounds, and stops the pair.

A round is a benign workload sent to both pairs: ``--requests`` greedy requests of ``--new-tokens`` tokens,
prompts of ``--min-prompt`` to ``--max-prompt`` token ids, paired directly (the same body to prefill and decode,
like the tests), in slices of ``--clients`` concurrent requests. Each slice goes to one pair and then to the
other, A B / B A alternating by slice, and which pair opens the round alternates by round; so the machine's drift
(other sessions' load on a shared host, above all) falls on both pairs alike. Only the measured pair has requests
at any time; the other one sleeps (``--sleep-on-idle``, a testbed flag of every pin) and each step first waits
``--settle-s``. New prompts each round (seeded, the same for A and B), so the radix cache of the long-lived vanilla
pair gains nothing over a fresh variant pair. A pair's throughput in a round = its output tokens / the summed wall
time of its slices; its latency = the median request time. The JSON carries every round's raw numbers, with the
CPU seconds of the measured pair, of the idle pair and of the whole machine (the rest is load from elsewhere).

Per variant: the per-round ratios variant / vanilla of output tokens/s (the verdict's metric), requests/s, p50
latency and CPU seconds; their means and seeded bootstrap 95 % intervals over the rounds; the verdict (the interval
lies above 1 - ``--resolution``: cost below it; below it; or straddles it: unresolved); and how many rounds the
observed spread would need for a +-``--resolution`` interval. ``--variants aa`` adds an A/A control (a second
vanilla pair): its interval shows what two pairs differ by with no guard at all, which interleaving cannot remove.
``--budget-s`` starts no further variant once the run has used that many seconds (they are reported as skipped).

Two clients by default: on the 2-core host, more concurrent requests than cores made round-to-round throughput
about twice as variable (coefficient of variation ~25 % vs ~12 % on one quiet pair).

    python3 scripts/bench_guards.py --variants vanilla,all --json /tmp/bench.json --markdown /tmp/bench.md
    python3 scripts/bench_guards.py --pin 0.5.23 --backend nixl --rounds 16
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_harden.testbed import benchstats, guardbench  # noqa: E402
from sglang_harden.testbed.guardbench import BASELINE, Variant, Workload  # noqa: E402
from sglang_harden.testbed.pd_topology import PDPair  # noqa: E402
from sglang_harden.testbed.pdbench import CONTEXT_LENGTH, POOL_TOKENS  # noqa: E402
from sglang_harden.testbed.profiles import PROFILES, get_profile  # noqa: E402

METRICS = ("tok_per_s", "req_per_s", "p50_s", "measured_cpu_s")


def _variants(text: str) -> list[str]:
    try:
        return guardbench.parse_variants(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pin", default="0.5.23")
    p.add_argument("--backend", default="mooncake", choices=["mooncake", "nixl"])
    p.add_argument("--profile", default="paged16", choices=sorted(PROFILES))
    p.add_argument("--variants", default=None, type=_variants,
                   help="comma-separated subset of " + ",".join(guardbench.KNOWN_VARIANTS)
                   + " (default: vanilla,all and every guard alone; vanilla is always the baseline)")
    p.add_argument("--rounds", type=int, default=12, help="measured A/B rounds per variant (>= 10 to resolve 1 %%)")
    p.add_argument("--requests", type=int, default=24, help="requests per pair per round")
    p.add_argument("--clients", type=int, default=2, help="concurrent requests per slice")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--min-prompt", type=int, default=100)
    p.add_argument("--max-prompt", type=int, default=300)
    p.add_argument("--settle-s", type=float, default=0.1, help="pause before each slice")
    p.add_argument("--budget-s", type=float, default=0.0, help="start no variant past this many seconds (0: none)")
    p.add_argument("--resolution", type=float, default=0.01)
    p.add_argument("--resamples", type=int, default=benchstats.DEFAULT_RESAMPLES)
    p.add_argument("--seed", type=int, default=benchstats.DEFAULT_SEED, help="seed of the bootstrap")
    p.add_argument("--server-flag", action="append", default=[], dest="server_flags", metavar="FLAG",
                   help="extra flag for every server of every variant (repeat)")
    p.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a new folder under /tmp)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the report (after each variant)")
    p.add_argument("--markdown", type=Path, default=None, metavar="PATH", help="write the table (after each variant)")
    args = p.parse_args(argv)
    if args.variants is None:
        args.variants = guardbench.parse_variants(None)
    if args.rounds < 2 or args.requests < 1 or args.clients < 1 or args.resamples < 1:
        p.error("--rounds must be >= 2, --requests, --clients and --resamples >= 1")
    if not 0 < args.min_prompt <= args.max_prompt < CONTEXT_LENGTH - args.new_tokens:
        p.error(f"need 0 < --min-prompt <= --max-prompt < {CONTEXT_LENGTH - args.new_tokens}")
    return args


def workload(args: argparse.Namespace) -> Workload:
    return Workload(requests=args.requests, clients=args.clients, new_tokens=args.new_tokens,
                    min_prompt=args.min_prompt, max_prompt=args.max_prompt)


def make_pair(args: argparse.Namespace, spec: Variant, log_dir: Path) -> PDPair:
    """A pair (not started) of the variant; every variant gets the same sizes, profile and flags."""
    return PDPair(
        args.pin, prefill_max_total_tokens=POOL_TOKENS, decode_max_total_tokens=POOL_TOKENS,
        context_length=CONTEXT_LENGTH, transfer_backend=args.backend, profile=get_profile(args.profile),
        env=spec.env, launcher_module=spec.launcher, log_dir=log_dir, prefill_flags=args.server_flags,
        decode_flags=args.server_flags, progress=True,
    )


def round_seed(block: int, round_index: int) -> int:
    """Prompt seed of a round (warm-up: ``round_index`` -1); distinct over the whole run."""
    return 1000 * (block + 1) + round_index + 1


def say(msg: str) -> None:
    print(f"[bench-guards] {msg}", file=sys.stderr, flush=True)


def run_round(args: argparse.Namespace, base: PDPair, pair: PDPair, name: str, seed: int,
              variant_first: bool) -> dict[str, Any]:
    """One round: the same prompts through vanilla and the variant, slice by slice (see ``guardbench.run_round``)."""
    first = name if variant_first else BASELINE
    shares = guardbench.run_round({BASELINE: base, name: pair}, first, workload(args).prompts(seed), workload(args),
                                  args.settle_s)
    return {"seed": seed, "first": first, "vanilla": shares[BASELINE].as_json(), "variant": shares[name].as_json()}


def summarize(args: argparse.Namespace, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per metric: the per-round ratios variant / vanilla, their mean and bootstrap interval."""
    out: dict[str, Any] = {}
    for metric in METRICS:
        values = benchstats.ratios([r["vanilla"][metric] for r in rounds], [r["variant"][metric] for r in rounds])
        summary = benchstats.summarize(values, args.resamples, args.seed)
        out[metric] = {**summary.as_json(), "per_round": [round(v, 5) for v in values]}
        by_order = {first: [v for v, r in zip(values, rounds, strict=True) if (r["first"] == BASELINE) == first]
                    for first in (True, False)}
        out[metric]["mean_vanilla_first"] = round(sum(by_order[True]) / max(1, len(by_order[True])), 5)
        out[metric]["mean_variant_first"] = round(sum(by_order[False]) / max(1, len(by_order[False])), 5)
    tput = out["tok_per_s"]
    out["rounds_for_resolution"] = benchstats.rounds_for_resolution(tput["stdev"], args.resolution)
    shares = [r[side] for r in rounds for side in ("vanilla", "variant")]
    elsewhere = sum(s["machine_cpu_s"] - s["measured_cpu_s"] - s["idle_cpu_s"] for s in shares)
    out["other_load_cores"] = round(elsewhere / sum(s["wall_s"] for s in shares), 3)
    out["idle_pair_cpu_share"] = round(sum(s["idle_cpu_s"] for s in shares) / sum(s["measured_cpu_s"] for s in shares),
                                       4)
    v = benchstats.verdict(tput["ci_low"], tput["ci_high"], args.resolution)
    out["verdict"] = {"text": v.text, "ci_includes_1": v.includes_one, "ci_above_threshold": v.above_threshold,
                      "ci_below_threshold": v.below_threshold, "threshold": round(1 - args.resolution, 4)}
    return out


def measure_variant(args: argparse.Namespace, base: PDPair, name: str, block: int, log_root: Path) -> dict[str, Any]:
    spec = guardbench.variant(name)
    entry: dict[str, Any] = {"variant": name, "launcher": spec.launcher, "env": spec.env}
    t0 = time.monotonic()
    with make_pair(args, spec, log_root / f"{block:02d}-{name}") as pair:
        entry["start_s"] = round(time.monotonic() - t0, 1)
        entry["armed"] = guardbench.armed_guards(pair)
        guardbench.check_armed(spec, entry["armed"])
        say(f"{name}: pair up in {entry['start_s']} s, armed {entry['armed']}; warm-up round")
        entry["warmup"] = run_round(args, base, pair, name, round_seed(block, -1), variant_first=False)
        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            rounds.append(run_round(args, base, pair, name, round_seed(block, r), variant_first=r % 2 == 1))
            last = rounds[-1]
            say(f"{name}: round {r + 1}/{args.rounds} first={last['first']} tok/s vanilla "
                f"{last['vanilla']['tok_per_s']:.1f} {name} {last['variant']['tok_per_s']:.1f} "
                f"(idle pair cpu {last['vanilla']['idle_cpu_s']:.2f}/{last['variant']['idle_cpu_s']:.2f} s)")
        entry["measure_s"] = round(time.monotonic() - t0 - entry["start_s"], 1)
    entry["runtime_s"] = round(time.monotonic() - t0, 1)
    entry["rounds"] = rounds
    entry["summary"] = summarize(args, rounds)
    return entry


def table_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for entry in report["variants"]:
        if "error" in entry:
            rows.append({"variant": entry["variant"], "error": entry["error"]})  # "failed: ..." / "skipped: ..."
            continue
        s = entry["summary"]
        tput, lat = s["tok_per_s"], s["p50_s"]
        rows.append({"variant": entry["variant"], "rounds": tput["rounds"], "mean": tput["mean"],
                     "ci_low": tput["ci_low"], "ci_high": tput["ci_high"], "verdict": s["verdict"]["text"],
                     "latency": (lat["mean"], lat["ci_low"], lat["ci_high"]),
                     "rounds_needed": s["rounds_for_resolution"], "other_cores": s["other_load_cores"],
                     "runtime_s": entry["runtime_s"]})
    return rows


def markdown(report: dict[str, Any]) -> str:
    w = report["workload"]
    head = [f"Guard cost on the CPU PD testbed: SGLang {report['pin']}, {report['backend']}, profile "
            f"{report['profile']}; {w['requests']} requests x {w['new_tokens']} new tokens per pair per round, in "
            f"slices of {w['clients']} concurrent requests; throughput ratio = output tokens/s variant / vanilla per "
            f"round (1.00 = same; higher is better), bootstrap {report['resamples']} resamples, seed "
            f"{report['seed']}; other load = CPU cores busy outside both pairs while measuring (a shared host's "
            f"other sessions).",
            "", f"Command: `{report['command']}`"]
    return benchstats.markdown_table(table_rows(report), head)


def write(args: argparse.Namespace, report: dict[str, Any]) -> None:
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if args.markdown is not None:
        args.markdown.write_text(markdown(report))


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    args = parse_args(raw)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds the pairs' context managers
    log_root = args.log_dir or Path(tempfile.mkdtemp(prefix="sglang-harden-bench-guards-"))
    log_root.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "command": shlex.join(["python3", "scripts/bench_guards.py", *raw]), "pin": args.pin,
        "backend": args.backend, "profile": get_profile(args.profile).describe(), "variants_requested":
        args.variants, "rounds": args.rounds, "workload": asdict(workload(args)), "settle_s": args.settle_s,
        "resolution": args.resolution, "resamples": args.resamples, "seed": args.seed,
        "server_flags": args.server_flags, "pool_tokens": POOL_TOKENS, "context_length": CONTEXT_LENGTH,
        "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(), "log_dir": str(log_root), "variants": [],
    }
    t0 = time.monotonic()
    say(f"vanilla pair starting (logs {log_root})")
    with make_pair(args, guardbench.variant(BASELINE), log_root / "00-vanilla") as base:
        report["baseline"] = {"armed": guardbench.armed_guards(base), "start_s": round(time.monotonic() - t0, 1)}
        guardbench.check_armed(guardbench.variant(BASELINE), report["baseline"]["armed"])
        for block, name in enumerate(args.variants, start=1):
            if args.budget_s and time.monotonic() - t0 > args.budget_s:
                report["variants"].append({"variant": name, "error": f"skipped: time budget {args.budget_s:.0f} s"})
                continue
            try:
                entry = measure_variant(args, base, name, block, log_root)
            except Exception as exc:  # a variant that fails to start or to serve is reported, the run goes on
                entry = {"variant": name, "error": "failed: " + str(exc).splitlines()[0][:300],
                         "detail": str(exc)[-4000:]}
                say(f"{name}: FAILED: {entry['error']}")
                if not all(part.is_alive() for part in base.parts()):
                    raise RuntimeError("the vanilla pair died; the run cannot go on") from exc
            else:
                say(f"{name}: {entry['summary']['verdict']['text']} (mean "
                    f"{entry['summary']['tok_per_s']['mean']:.4f}), {entry['runtime_s']:.0f} s")
            report["variants"].append(entry)
            report["elapsed_s"], report["loadavg_end"] = round(time.monotonic() - t0, 1), os.getloadavg()
            write(args, report)
    write(args, report)  # with the variants the time budget skipped
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
