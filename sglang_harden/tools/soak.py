"""``sglang-harden soak``: mixed, hostile traffic on a real PD topology, judged by oracles the guards do not own.

    sglang-harden soak --pin 0.5.19 --compare --duration 600 --concurrency 32 --json
    sglang-harden soak --pin 0.5.23 --backend nixl --prefills 2 --decodes 2 --duration 120   # 2P/2D, router
    sglang-harden soak --state ~/.sglang-harden/testbed/pair.json --duration 120   # a pair already running

Starts the topology itself (testbed pin venv, profile ``paged16`` by default) unless ``--state`` names one started
with ``sglang-harden testbed start``. See ``sglang_harden.testbed.soak`` for the load and the oracles. Exit code:
0 when every hardened (or ``--state``) run held every promise the soak checks, 1 otherwise, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from sglang_harden.testbed.profiles import PROFILES

if TYPE_CHECKING:
    from sglang_harden.testbed.soak_judging import SoakReport
    from sglang_harden.testbed.soak_spec import SoakLoad


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from sglang_harden.testbed.soak_spec import SoakTopology

    parser.add_argument("--pin", help="SGLang pin whose testbed venv runs the servers (not with --state)")
    parser.add_argument("--backend", default="mooncake", choices=("mooncake", "nixl"))
    parser.add_argument("--profile", default="paged16", choices=sorted(PROFILES))
    parser.add_argument("--router", action="store_true", help="send requests through sglang-router (PD mode)")
    parser.add_argument("--prefills", type=int, default=1, help="prefill servers; >1 (or --decodes >1): a fleet"
                        " behind sglang-router")
    parser.add_argument("--decodes", type=int, default=1, help="decode servers (e.g. --prefills 2 --decodes 2)")
    parser.add_argument("--decode-pool-tokens", type=int, default=SoakTopology.decode_max_total_tokens,
                        help="each decode server's KV pool (--max-total-tokens; default %(default)s: one"
                        " request's pages stay under the 2 %% quarantine bound)")
    parser.add_argument("--prefill-pool-tokens", type=int, default=640,
                        help="each prefill server's KV pool (default 640: below the context, so oversized prompts"
                        " reach the incident)")
    parser.add_argument("--state", type=Path, help="drive a pair started by 'sglang-harden testbed start'")
    variant = parser.add_mutually_exclusive_group()
    variant.add_argument("--compare", action="store_true", help="vanilla, then hardened, same load; ratios")
    variant.add_argument("--vanilla", action="store_true", help="vanilla servers only")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load per run (default 60)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--oversized-share", type=float, default=0.05)
    parser.add_argument("--disconnect-share", type=float, default=0.1)
    parser.add_argument("--abort-burst-every", type=float, default=15.0, help="seconds; 0 = no bursts")
    parser.add_argument("--abort-burst-size", type=int, default=3)
    parser.add_argument("--late-writes", type=int, default=0,
                        help="requests whose KV write lands late after a failed engine call (test-only shim on"
                        " the servers the soak starts; paired directly or through the router)")
    parser.add_argument("--late-write-delay", type=float, default=8.0, help="seconds until a late write lands")
    parser.add_argument("--forged-control-every", type=float, default=5.0,
                        help="seconds between rounds of forged control-plane requests (no secret) at every prefill"
                        " bootstrap port; a hardened run must refuse them all (0 = none)")
    parser.add_argument("--log-dir", type=Path, help="where server logs and traces go (default: a temp folder)")
    parser.add_argument("--json", action="store_true", help="print the reports as JSON")


def _bad(message: str) -> int:
    print(f"sglang-harden soak: {message}", file=sys.stderr)
    return 2


def _load(args: argparse.Namespace) -> SoakLoad:
    from sglang_harden.testbed.soak_spec import SoakLoad

    return SoakLoad(duration_s=args.duration, concurrency=args.concurrency, tenants=args.tenants, seed=args.seed,
                    oversized_share=args.oversized_share, disconnect_share=args.disconnect_share,
                    abort_burst_every_s=args.abort_burst_every, abort_burst_size=args.abort_burst_size,
                    late_writes=args.late_writes, late_write_delay_s=args.late_write_delay,
                    forged_control_every_s=args.forged_control_every)


def _check(args: argparse.Namespace) -> str | None:
    if args.duration <= 0 or args.concurrency < 1 or args.tenants < 1 or args.prefills < 1 or args.decodes < 1:
        return "--duration, --concurrency, --tenants, --prefills and --decodes must be positive"
    if not 0 <= args.oversized_share + args.disconnect_share <= 1 or min(args.oversized_share,
                                                                         args.disconnect_share) < 0:
        return "--oversized-share and --disconnect-share must be >= 0 and add up to at most 1"
    if args.state is None and not args.pin:
        return "give --pin (start a topology) or --state (drive a running one)"
    if args.prefill_pool_tokens < 64 or args.decode_pool_tokens < 64:
        return "--prefill-pool-tokens and --decode-pool-tokens must be at least 64"
    if args.forged_control_every < 0:
        return "--forged-control-every must be >= 0"
    if args.late_writes < 0 or args.late_write_delay <= 0:
        return "--late-writes must be >= 0 and --late-write-delay positive"
    if args.late_writes and args.state is not None:
        return "--late-writes needs servers the soak starts (the fault is set in their env): not with --state"
    if args.state is not None and (args.compare or args.vanilla):
        return "--compare/--vanilla start their own servers; not with --state"
    if args.state is not None and not args.state.is_file():
        return f"no state file at {args.state}"
    return None


def run(args: argparse.Namespace) -> int:
    problem = _check(args)
    if problem:
        return _bad(problem)
    from sglang_harden.testbed import soak, soak_report, soak_spec

    load = _load(args)
    if args.state is not None:
        return _run_state(args, load)
    fleet = args.prefills > 1 or args.decodes > 1
    topo = soak_spec.SoakTopology(pin=args.pin, backend=args.backend, profile=args.profile,
                                  router=args.router or fleet, prefills=args.prefills, decodes=args.decodes,
                                  prefill_max_total_tokens=args.prefill_pool_tokens,
                                  decode_max_total_tokens=args.decode_pool_tokens)
    root = args.log_dir or Path(tempfile.mkdtemp(prefix="sglang-harden-soak-"))
    variants = [False, True] if args.compare else [False] if args.vanilla else [True]
    reports = []
    for hardened in variants:
        name = "hardened" if hardened else "vanilla"
        reports.append(soak.run_variant(topo, load, hardened, root, soak_report.progress_line(f"{args.pin} {name}")))
    ratios = soak_report.compare(reports[0], reports[1]) if args.compare else None
    _print(args, reports, ratios)
    judged = [r for r in reports if r.variant == "hardened"] or reports
    if args.compare and not reports[0].control_fired():
        print("soak --compare: the vanilla run showed no harm (no foreign KV read, no oversized prompt served), so "
              "the hardened run's clean verdict shows nothing; add transfer faults (--late-writes) or use a pin "
              "whose vanilla pair leaks", file=sys.stderr)
        return 1
    return 1 if any(r.violations() for r in judged) else 0


def _run_state(args: argparse.Namespace, load: SoakLoad) -> int:
    from sglang_harden.testbed import soak, soak_report, soak_requests, soak_spec

    try:
        state = json.loads(args.state.read_text())
        target = soak_requests.Target.of_state(state)
    except (ValueError, KeyError, TypeError) as exc:
        return _bad(f"{args.state} is not a testbed state file: {exc!r}")
    topo = soak_spec.SoakTopology(pin=str(state.get("pin", "?")), backend=args.backend,
                                  profile=str(state.get("profile", args.profile)))
    report = soak.drive(target, load, topo, "running", None, soak_report.progress_line("running"),
                        str(state.get("log_dir")))
    _print(args, [report], None)
    return 1 if report.violations() else 0


def _print(args: argparse.Namespace, reports: list[SoakReport], ratios: dict[str, float | None] | None) -> None:
    from sglang_harden.testbed import soak_report

    if sys.stderr.isatty():
        print(file=sys.stderr)
    if args.json:
        print(json.dumps({"reports": [r.to_dict() for r in reports], "hardened_over_vanilla": ratios}, indent=2))
    else:
        print(soak_report.render(reports, ratios))
