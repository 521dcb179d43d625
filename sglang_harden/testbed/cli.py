"""``sglang-harden testbed {envs,build-model,start,stop}``.

- ``envs [PIN...|--ci|--all] [--build]``: show (or build) the per-pin venvs of ci/pins.toml.
- ``build-model --pin X``: build/cache the tiny model with that pin's transformers; prints its folder.
- ``start --pin X``: start a prefill+decode pair (optionally the router) and leave it running; writes a state
  file (urls, ports, process groups, logs) and prints it as JSON.
- ``stop``: stop the pair named by a state file (kills exactly the recorded process groups).
- ``python --pin X [ARGS...]``: run the pin venv's python with the testbed environment (CPU settings and
  test-only shims), e.g. ``python --pin 0.5.23 -m pytest tests/integration/test_lifecycle_inprocess.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sglang_harden.testbed import envs, procs
from sglang_harden.testbed.profiles import PROFILE_ENV, PROFILES, get_profile


def _state_path(args: argparse.Namespace) -> Path:
    if args.state:
        return Path(args.state)
    return envs.harden_home() / "testbed" / f"{args.name}.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="testbed_command", metavar="ACTION", required=True)
    p_env = sub.add_parser("envs", help="show or build the per-pin environments")
    p_env.add_argument("pins", nargs="*", help="pins (default: all in ci/pins.toml); --ci / --all")
    p_env.add_argument("--ci", action="store_true", help="the CI pins")
    p_env.add_argument("--all", action="store_true", help="every pin")
    p_env.add_argument("--build", action="store_true", help="build what is missing or outdated")
    p_env.add_argument("--json", action="store_true")

    p_model = sub.add_parser("build-model", help="build the tiny model with a pin's transformers")
    p_model.add_argument("--pin", required=True)
    p_model.add_argument("--force", action="store_true")

    p_start = sub.add_parser("start", help="start a prefill+decode pair and leave it running")
    p_start.add_argument("--pin", required=True)
    p_start.add_argument("--prefill-max-total-tokens", type=int, default=256)
    p_start.add_argument("--decode-max-total-tokens", type=int, default=400)
    p_start.add_argument("--context-length", type=int, default=512)
    p_start.add_argument("--num-reserved-decode-tokens", type=int, default=32)
    p_start.add_argument("--transfer-backend", default="mooncake")
    p_start.add_argument("--router", action="store_true", help="also start sglang-router in PD mode")
    p_start.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default=None,
        help=f"KV layout: page size, radix cache, chunked prefill, early send (default: ${PROFILE_ENV} or minimal)",
    )
    p_start.add_argument(
        "--hardened", action="store_true", help="launch via sglang_harden.launch_server with SGLANG_HARDEN_ACTIVATE=1"
    )
    p_start.add_argument("--env", action="append", default=[], metavar="K=V", help="extra env for both servers")
    p_start.add_argument("--log-dir", default=None)
    p_start.add_argument("--timeout", type=float, default=600.0)
    p_python = sub.add_parser("python", help="run a pin venv's python with the testbed environment")
    p_python.add_argument("--pin", required=True)
    p_python.add_argument("args", nargs=argparse.REMAINDER, help="arguments for python")
    for p in (p_start, sub.add_parser("stop", help="stop a pair started with 'start'")):
        p.add_argument("--name", default="pair", help="state name (default: pair)")
        p.add_argument("--state", default=None, help="state file (default: $SGLANG_HARDEN_HOME/testbed/NAME.json)")


def _envs(args: argparse.Namespace) -> int:
    pins = (
        envs.select_pins([*args.pins, *(["--ci"] if args.ci else []), *(["--all"] if args.all else [])])
        if (args.pins or args.ci or args.all)
        else envs.all_pins()
    )
    if args.build:
        for pin in pins:
            envs.ensure_env(pin)
    rows = [envs.env_status(pin) for pin in pins]
    if args.json:
        print(json.dumps(rows))
    else:
        for row in rows:
            state = "ready" if row["built"] else "MISSING (scripts/setup_envs.sh " + str(row["pin"]) + ")"
            pkg = "" if row["package_current"] or not row["built"] else "  (sglang-harden checkout not installed)"
            print(f"{row['pin']:<14} {state:<10} {row['path']}{pkg}")
    return 0 if all(r["built"] for r in rows) else 1


def _start(args: argparse.Namespace) -> int:
    from sglang_harden.testbed.pd_topology import PDPair
    from sglang_harden.testbed.server import HARDENED_LAUNCHER, VANILLA_LAUNCHER

    state = _state_path(args)
    if state.exists():
        print(
            f"state file {state} exists: stop that pair first (sglang-harden testbed stop --state {state})",
            file=sys.stderr,
        )
        return 1
    env = dict(kv.split("=", 1) for kv in args.env)
    if args.hardened:
        env["SGLANG_HARDEN_ACTIVATE"] = "1"
    pair = PDPair(
        args.pin,
        prefill_max_total_tokens=args.prefill_max_total_tokens,
        decode_max_total_tokens=args.decode_max_total_tokens,
        context_length=args.context_length,
        num_reserved_decode_tokens=args.num_reserved_decode_tokens,
        transfer_backend=args.transfer_backend,
        profile=get_profile(args.profile) if args.profile else None,
        env=env,
        router=args.router,
        launcher_module=HARDENED_LAUNCHER if args.hardened else VANILLA_LAUNCHER,
        log_dir=Path(args.log_dir) if args.log_dir else None,
        startup_timeout=args.timeout,
        progress=True,
    )
    pair.start()
    pair.detach()
    info = pair.describe()
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps(info, indent=2))
    print(json.dumps({**info, "state": str(state)}))
    return 0


def _stop(args: argparse.Namespace) -> int:
    state = _state_path(args)
    if not state.exists():
        print(f"no state file {state}", file=sys.stderr)
        return 1
    info = json.loads(state.read_text())
    groups = []
    for role in ("router", "prefill", "decode"):
        pgid = (info.get(role) or {}).get("pgid")
        ticks = (info.get(role) or {}).get("start_ticks")
        if pgid and ticks is not None and procs.start_ticks(pgid) == ticks:  # not a reused pid
            groups.append(int(pgid))
    left = procs.kill_groups(groups)
    state.unlink()
    print(json.dumps({"stopped": groups, "still_alive": left}))
    return 0 if not left else 1


def _python(args: argparse.Namespace) -> int:
    import os

    from sglang_harden.testbed.procenv import testbed_env

    python = envs.require_env(args.pin)
    argv = [a for a in args.args if a != "--"] if args.args[:1] == ["--"] else list(args.args)
    sys.stdout.flush()
    os.execve(str(python), [str(python), *argv], testbed_env(envs.get_recipe(args.pin)))
    return 0  # not reached


def run(args: argparse.Namespace) -> int:
    try:
        if args.testbed_command == "envs":
            return _envs(args)
        if args.testbed_command == "build-model":
            from sglang_harden.testbed.model import build_tiny_model

            print(build_tiny_model(args.pin, force=args.force))
            return 0
        if args.testbed_command == "start":
            return _start(args)
        if args.testbed_command == "python":
            return _python(args)
        return _stop(args)
    except envs.EnvError as exc:
        print(f"sglang-harden testbed: {exc}", file=sys.stderr)
        return 2
