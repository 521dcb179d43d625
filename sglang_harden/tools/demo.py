"""``sglang-harden demo``: the PD incident on the embedded tiny model, per pin, as a side-by-side table.

Per pin and variant, one fresh prefill+decode pair (asymmetric pools, Mooncake TCP on loopback): tenant A
sends distinctive content, tenant B an oversized greedy prompt. Shows B's HTTP status, B's output, how many
of A's KV rows B's first decode step read (white-box tracer), and a verdict. Progress goes to stderr.

Variants are columns: ``vanilla`` (``python -m sglang.launch_server``) and, through :func:`add_variant`,
``hardened`` (``python -m sglang_harden.launch_server`` with ``SGLANG_HARDEN_ACTIVATE=1``).

``--scenario late-write`` runs the late-write fault injection instead (``sglang_harden.testbed.latewrite``: a KV
write that lands after decode gave up on it) over ``--backend mooncake`` (default) or ``nixl``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sglang_harden.testbed.incident import IncidentSetup
from sglang_harden.testbed.incident import run_incident as _run_incident
from sglang_harden.testbed.latewrite import BACKENDS as LATE_WRITE_BACKENDS

SCENARIOS = ("incident", "late-write")
BACKENDS = LATE_WRITE_BACKENDS
Runner = Callable[[str], dict[str, Any]]


def _progress(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


def run_incident(
    pin: str,
    hardened: bool,
    *,
    setup: IncidentSetup | None = None,
    log_dir: Path | None = None,
    progress: bool = True,
    **kwargs: Any,
) -> dict[str, Any]:
    """Run the incident scenario on ``pin`` (fresh servers, stopped afterwards) and return its summary."""
    return _run_incident(
        pin,
        hardened,
        setup=setup or IncidentSetup(),
        log_dir=log_dir,
        progress=_progress if progress else None,
        **kwargs,
    )


def vanilla(pin: str) -> dict[str, Any]:
    return run_incident(pin, hardened=False)


# The scenario's pools are deliberately too small for its context, which the capacity gate refuses by default
# (shown by ``capacity_default_refuses``); the hardened column runs the gate in log mode so that what stops the
# leak is the request-path guards.
HARDENED_ENV = {"SGLANG_HARDEN_CAPACITY": "log"}


def hardened(pin: str) -> dict[str, Any]:
    result = run_incident(pin, hardened=True, harden_env=HARDENED_ENV)
    result["capacity_default"] = capacity_default_refuses(pin)
    return result


def capacity_default_refuses(pin: str, setup: IncidentSetup | None = None) -> dict[str, Any]:
    """Start the scenario's prefill hardened with the default capacity gate; it must refuse to start."""
    import tempfile

    from sglang_harden.testbed.server import HARDENED_LAUNCHER, Server, ServerError

    setup = setup or IncidentSetup()
    server = Server(pin, "prefill", max_total_tokens=setup.prefill_max_total_tokens,
                    context_length=setup.context_length, env={"SGLANG_HARDEN_ACTIVATE": "1"},
                    launcher_module=HARDENED_LAUNCHER, log_dir=Path(tempfile.mkdtemp(prefix="sglang-harden-cap-")),
                    name=f"capacity-gate-{pin}")
    _progress(f"{pin} hardened: checking that the default capacity gate refuses this configuration")
    try:
        server.start().wait_ready()
        refused = False
    except ServerError:
        refused = True
    finally:
        server.stop()
    lines = [ln for ln in server.log_text().splitlines() if "sglang-harden capacity gate:" in ln]
    return {"refused": refused, "exit_code": server.proc.returncode if server.proc else None,
            "message": lines[-1].split("sglang-harden capacity gate:", 1)[1].strip()[:300] if lines else None}


# The columns of the report, in order. A new column is one call: add_variant(name, runner).
VARIANTS: dict[str, Runner] = {"vanilla": vanilla, "hardened": hardened}


def add_variant(name: str, runner: Runner) -> None:
    VARIANTS[name] = runner


def _error_result(pin: str, variant: str, exc: BaseException) -> dict[str, Any]:
    return {
        "pin": pin,
        "variant": variant,
        "b_status": None,
        "b_output_short": "-",
        "pages_of_a_read_by_b": None,
        "verdict": "error",
        "error": f"{type(exc).__name__}: {exc}"[:2000],
    }


def collect(pins: Sequence[str], scenario: str = "incident") -> dict[str, Any]:
    report: dict[str, Any] = {"scenario": scenario, "pins": {}}
    for pin in pins:
        report["pins"][pin] = {}
        for name, runner in VARIANTS.items():
            try:
                report["pins"][pin][name] = runner(pin)
            except Exception as exc:  # one broken pin must not hide the others
                _progress(f"{pin} {name}: ERROR {exc}")
                report["pins"][pin][name] = _error_result(pin, name, exc)
    return report


def _cell(res: dict[str, Any]) -> list[str]:
    status = res.get("b_status")
    prefill = res.get("b_prefill_status")
    suffix = f" (prefill {prefill})" if prefill not in (None, 200) else ""
    status_txt = "-" if status is None else f"{status}{suffix}"
    pages = res.get("pages_of_a_read_by_b")
    verdict = str(res.get("verdict"))
    if res.get("pools_full_at_quiesce") is False:
        verdict += "; pools NOT full at quiesce"
    gate = res.get("capacity_default")
    if gate is not None:
        verdict += "; default capacity gate " + ("refused to start" if gate.get("refused") else "DID NOT refuse")
    return [
        status_txt,
        str(res.get("b_output_short", "-")),
        "-" if pages is None else str(pages),
        _front_door_cell(res.get("front_door")),
        verdict,
    ]


def _front_door_cell(door: dict[str, Any] | None) -> str:
    if not door:
        return "-"
    return f"{door.get('decode_status')} after {door.get('decode_elapsed_s')} s"


def render_table(report: dict[str, Any]) -> str:
    head = ["pin", "variant", "B HTTP status", "B output (first ids)", "A rows read by B", "front door (decode)",
            "verdict"]
    rows = [head]
    for pin, variants in report["pins"].items():
        for name, res in variants.items():
            rows.append([pin, name, *_cell(res)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def default_pins() -> list[str]:
    from sglang_harden.testbed.envs import ci_pins

    return ci_pins()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pin",
        action="append",
        dest="pins",
        metavar="X",
        help="SGLang pin (repeatable; default: the CI pins of ci/pins.toml)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--scenario", choices=SCENARIOS, default="incident")
    parser.add_argument("--backend", choices=BACKENDS, default="mooncake",
                        help="PD transfer backend of --scenario late-write (nixl: pins whose pins.toml lists it)")


def run(args: argparse.Namespace) -> int:
    from sglang_harden.testbed.envs import EnvError, require_env

    pins = args.pins or default_pins()
    try:
        for pin in pins:
            require_env(pin)
    except EnvError as exc:
        print(f"sglang-harden demo: {exc}", file=sys.stderr)
        return 2
    if args.scenario == "late-write":
        return run_late_write(pins, args.backend, args.json)
    if args.backend != "mooncake":
        print("sglang-harden demo: --backend applies to --scenario late-write", file=sys.stderr)
        return 2
    report = collect(pins, args.scenario)
    if args.json:
        print(json.dumps(report, indent=None, sort_keys=False))
    else:
        print(render_table(report))
    errors = [p for p, v in report["pins"].items() for r in v.values() if r.get("verdict") == "error"]
    return 1 if errors or not hardened_blocked(report) else 0


def run_late_write(pins: Sequence[str], backend: str, as_json: bool) -> int:
    """The late-write scenario, vanilla vs hardened per pin; 0 when every hardened run is clean with every page
    back at quiesce."""
    from sglang_harden.testbed.latewrite import LateWriteSetup, collect_report, print_report

    report = collect_report(list(pins), setup=LateWriteSetup(backend=backend), say=_progress)
    print_report(report, as_json)
    return 0 if report["ok"] else 1


FRONT_DOOR_BOUND_S = 5.0


def front_door_released(res: dict[str, Any]) -> bool:
    """Decode answered the front-door refusal with a 4xx, promptly, without generating."""
    door = res.get("front_door") or {}
    status = door.get("decode_status") or 0
    return 400 <= status < 500 and door.get("decode_elapsed_s", 1e9) < FRONT_DOOR_BOUND_S and not door.get(
        "decode_generated", True)


def hardened_blocked(report: dict[str, Any]) -> bool:
    """Every hardened column: B refused (4xx), no completion, none of A's KV read, both allocators back to full
    capacity at quiesce, a front-door refusal released decode promptly, and the default capacity gate refused
    the scenario's pools."""
    for variants in report["pins"].values():
        res = variants.get("hardened")
        if res is None:
            continue
        status = res.get("b_status") or 0
        if not (400 <= status < 500) or res.get("b_output_ids") or res.get("pages_of_a_read_by_b"):
            return False
        if not (res.get("capacity_default") or {}).get("refused"):
            return False
        if not res.get("pools_full_at_quiesce") or not front_door_released(res):
            return False
    return True
