"""``sglang-harden model check``: explore the PD handoff model under one policy and report.

Exit status: 0 no violation, 1 a counterexample was found, 2 bad arguments or a configuration the capacity
gate refuses.
"""

from __future__ import annotations

import argparse
import json
import sys

from sglang_harden.protocol.explorer import ExploreResult, explore
from sglang_harden.protocol.model import Model
from sglang_harden.protocol.policies import (
    LIFECYCLE_RULES,
    MODELLED_GUARDS,
    UNMODELLED_GUARDS,
    ConfigRefused,
    make_policy,
)
from sglang_harden.protocol.scenarios import INCIDENT_REQUESTS, TRUNCATE_REQUESTS, build_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    check = sub.add_parser("check", help="bounded exhaustive exploration of the PD handoff model")
    check.add_argument("--policy", choices=("vanilla", "hardened"), default="hardened")
    check.add_argument("--requests", type=int, default=2, help="scripted requests (default 2)")
    check.add_argument("--pages", type=int, default=3, help="KV pages per node (default 3)")
    check.add_argument("--depth", type=int, default=40, help="events per path (default 40)")
    check.add_argument("--max-states", type=int, default=None, help="stop after this many states")
    check.add_argument(
        "--disable",
        action="append",
        default=[],
        metavar="GUARD",
        help="hardened guard to turn off (repeatable, or comma-separated): "
        + ", ".join(MODELLED_GUARDS + LIFECYCLE_RULES),
    )
    check.add_argument("--all", action="store_true", help="keep going and report one trace per property")
    check.add_argument("--no-client-events", action="store_true", help="no client aborts or disconnects")
    check.add_argument("--no-timeouts", action="store_true", help="no timeouts on either node")
    check.add_argument("--fault", action="append", default=[], choices=("misowned_page",))
    check.add_argument(
        "--scenario",
        choices=("default", "incident", "truncate"),
        default="default",
        help="request script: default (see scenarios.py), incident (A fits, B too long for prefill), "
        "truncate (B truncated by prefill)",
    )
    check.add_argument("--capacity", choices=("enforce", "clamp", "log", "off"), default="log")
    check.add_argument("--json", action="store_true", help="one JSON object on stdout")


def _disabled(raw: list[str]) -> tuple[str, ...]:
    return tuple(name.strip() for item in raw for name in item.split(",") if name.strip())


def run(args: argparse.Namespace) -> int:
    disabled = _disabled(args.disable)
    specs = {"incident": INCIDENT_REQUESTS, "truncate": TRUNCATE_REQUESTS}.get(args.scenario)
    config = build_config(
        args.requests,
        args.pages,
        specs=specs,
        client_events=not args.no_client_events,
        timeouts=not args.no_timeouts,
        faults=frozenset(args.fault),
        capacity_mode=args.capacity,
    )
    try:
        policy = make_policy(args.policy, config, disabled)
    except ConfigRefused as refused:
        print(f"capacity gate refuses this configuration: {refused}", file=sys.stderr)
        return 2
    except ValueError as bad:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    result = explore(Model(config, policy), args.depth, args.max_states, not args.all, disabled)
    _report(result, config, disabled, args.json)
    return 1 if result.counterexamples else 0


def _report(result: ExploreResult, config: object, disabled: tuple[str, ...], as_json: bool) -> None:
    unmodelled = {g: why for g, why in UNMODELLED_GUARDS.items() if g in disabled}
    if as_json:
        payload = {
            "policy": result.policy,
            "disabled": list(disabled),
            "states": result.states,
            "transitions": result.transitions,
            "depth": result.depth_reached,
            "exhausted": result.exhausted,
            "seconds": round(result.seconds, 3),
            "cpu_seconds": round(result.cpu_seconds, 3),
            "violations": [ce.to_json() for ce in result.counterexamples.values()],
            "not_modelled": unmodelled,
            "config": repr(config),
        }
        print(json.dumps(payload, indent=2))
        return
    print(result.summary())
    for guard, why in unmodelled.items():
        print(f"note: {guard} is not expressed by the model ({why})")
    for counterexample in result.counterexamples.values():
        print(counterexample.format())
