"""``sglang-harden doctor``: which protections this SGLang build has, which sglang-harden adds, which are on.

Native protections are judged from the code itself (:mod:`sglang_harden.tools._protections` documents what
is looked for per protection), never from the version string, so a backported or patched build counts.
What sglang-harden supplies comes from ``sglang_harden.compat.describe()``. Runtime switches are read from
this process's environment and from ``--launch-args`` (the flags the server is, or will be, started with).

``--matrix`` prints instead the guard x pin x path matrix built from end-to-end results (:mod:`.matrix`).

Exit codes: 0 every protection is covered (natively on, switched on, or supplied by sglang-harden);
1 at least one is missing; 2 no SGLang source could be read (``--matrix``: no usable results).
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path

from sglang_harden.tools import _protections as P
from sglang_harden.tools._render import dump_json, table
from sglang_harden.tools._source import SourceTree
from sglang_harden.tools.launch_shapes import armed_guards, flag_value, shape_state

EXIT_OK, EXIT_MISSING, EXIT_NO_SGLANG = 0, 1, 2
COMPAT_UNAVAILABLE = "sglang-harden compat layer not available"
_TRUE = {"1", "true", "yes", "on", "y", "t"}
_FALSE = {"0", "false", "no", "off", "n", "f", ""}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n\n", 1)[1]
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument(
        "--sglang-root",
        type=Path,
        help="inspect this source tree (a directory containing sglang/, e.g. an unpacked wheel) "
        "instead of the SGLang importable here",
    )
    parser.add_argument(
        "--launch-args",
        default="",
        help="the server's command-line flags, quoted, to report flag switches "
        '(e.g. "--kv-canary log --disaggregation-enable-kv-checksum")',
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show the code evidence per row")
    parser.add_argument("--matrix", action="store_true",
                        help="print the guard x pin x path matrix built from e2e results (see --results) instead")
    parser.add_argument("--results", type=Path, default=Path("docs/e2e-results"),
                        help="with --matrix: the e2e results directory (scripts/matrix.sh writes it; default "
                        "docs/e2e-results)")


@dataclass
class HardenInfo:
    """What the compat layer says about the pin; ``available`` False when it cannot be imported."""

    available: bool
    note: str = ""
    pin: str | None = None
    family: str | None = None
    supported: bool | None = None
    guards: dict[str, dict[str, bool]] | None = None


@dataclass
class Row:
    key: str
    title: str
    native: P.Native
    guard: str | None
    supplied: bool | None
    guard_active: bool | None
    switch: str | None
    switch_value: str | None
    verdict: str

    @property
    def missing(self) -> bool:
        return self.verdict == "MISSING"


# ---------------------------------------------------------------------------------------------- compat


def harden_info(version: str | None) -> HardenInfo:
    """The compat layer's view of ``version``: ``describe()`` when it describes that pin, else the pin table."""
    try:
        compat = importlib.import_module("sglang_harden.compat")
        raw = compat.describe()
    except Exception as exc:  # noqa: BLE001 - any failure means "not available", said plainly
        return HardenInfo(False, f"{COMPAT_UNAVAILABLE} ({type(exc).__name__}: {exc})")
    if not isinstance(raw, dict):
        return HardenInfo(False, f"{COMPAT_UNAVAILABLE}: describe() returned {type(raw).__name__}")
    pin = _opt_str(raw.get("pin"))
    if version and pin != version:
        return _info_from_pin_table(compat, version, raw, pin)
    family = _opt_str(raw.get("family"))
    supported = raw.get("supported") if isinstance(raw.get("supported"), bool) else None
    guards = _guards_from_describe(compat, raw, family)
    return HardenInfo(True, pin=pin, family=family, supported=supported, guards=guards)


def _info_from_pin_table(compat: object, version: str, raw: dict, pin: str | None) -> HardenInfo:
    table_ = getattr(compat, "SUPPORTED_PINS", None)
    note = f"compat.describe() is about the installed SGLang ({pin or 'none'}); this tree is {version}"
    if not isinstance(table_, dict):
        return HardenInfo(True, note + "; no pin table to consult", pin=version)
    family = table_.get(version)
    guards = None
    if family is not None:
        modes, _ = guard_modes(dict(os.environ))
        enabled = [g for g, mode in modes.items() if mode != "off"]
        raw = {**raw, "guards_supplied": enabled, "active_in_this_process": False, "hooks_in_place": {}}
        guards = _guards_from_describe(compat, raw, family)
    return HardenInfo(True, note, pin=version, family=family, supported=family is not None, guards=guards)


def _family_hooks(family: str | None) -> dict[str, list[str]] | None:
    """owner -> required hook targets of the family's hook table, or None when it cannot be read (an optional
    hook's target is one only some releases have; where it is absent, nothing needs it)."""
    if not family:
        return None
    try:
        module = importlib.import_module(f"sglang_harden.compat.{family}")
        hooks = module.HOOKS
    except Exception:  # noqa: BLE001
        return None
    out: dict[str, list[str]] = {}
    for hook in hooks:
        targets = out.setdefault(str(hook.owner), [])
        if not getattr(hook, "optional", False):
            targets.append(str(hook.target))
    return out


def _guards_from_describe(compat: object, raw: dict, family: str | None) -> dict[str, dict[str, bool]]:
    """{guard: {supplied, active}}. A guard counts as supplied only if it is enabled (``guards_supplied``)
    and, where the family's hook table is readable, the family actually hooks something for it."""
    supplied = raw.get("guards_supplied", raw.get("guards", []))
    names = list(supplied) if isinstance(supplied, list | tuple | dict) else []
    table_ = getattr(compat, "SUPPORTED_PINS", {})
    module = table_.get(raw.get("pin") or "", family) if isinstance(table_, dict) else family
    owners = _family_hooks(module) or _family_hooks(family)
    in_place = raw.get("hooks_in_place") if isinstance(raw.get("hooks_in_place"), dict) else {}
    activated = bool(raw.get("active_in_this_process"))
    out: dict[str, dict[str, bool]] = {}
    for name in map(str, names):
        targets = None if owners is None else owners.get(name)
        hooked = owners is None or bool(targets)
        active = activated and hooked and all(in_place.get(t, False) for t in (targets or []))
        out[name] = {"supplied": hooked, "active": active}
    return out


def _opt_str(value: object) -> str | None:
    return None if value is None else str(value)


# ---------------------------------------------------------------------------------------------- switches


def switch_value(switch: str | None, launch_args: list[str], environ: dict[str, str]) -> str | None:
    if switch is None:
        return None
    if switch.startswith("--"):
        return flag_value(launch_args, switch)
    if switch == P.BACKPORT_SECRET_ENV:  # the backport's authentication: on with a secret file, unless off
        if environ.get("SGLANG_HARDEN_BOOTSTRAP_AUTH", "").strip().lower() == "off":
            return "off"
        return "on" if environ.get(switch, "").strip() else None
    if switch == P.BACKPORT_ZMQ_SWITCH:  # the backport's side channels: with the control plane's secret, unless off
        if "off" in (environ.get(switch, "").strip().lower(), switch_value(P.BACKPORT_SECRET_ENV, [], environ)):
            return "off"
        return switch_value(P.BACKPORT_SECRET_ENV, [], environ)
    return environ.get(switch)


def switched_on(native: P.Native, value: str | None) -> bool | None:
    """True/False when the switch says so explicitly; None when unset (the build's default applies)."""
    if value is None:
        return None
    lowered = value.strip().lower()
    if native.switch and native.switch.endswith("BATCH_INDICES"):
        try:
            return int(lowered) > 0
        except ValueError:
            return None
    if native.switch == "--kv-canary":
        return lowered not in ("none", "")
    if lowered == "set" or lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    return None


# ---------------------------------------------------------------------------------------------- rows


_MODES_CACHE: dict[tuple, tuple[dict[str, str], str | None]] = {}


def guard_modes(environ: dict[str, str]) -> tuple[dict[str, str], str | None]:
    """Each guard's mode from SGLANG_HARDEN_* (read once per distinct setting), or the config error."""
    key = tuple(sorted((k, v) for k, v in environ.items() if k.startswith("SGLANG_HARDEN_")))
    if key not in _MODES_CACHE:
        _MODES_CACHE[key] = _read_modes(environ)
    return _MODES_CACHE[key]


def _read_modes(environ: dict[str, str]) -> tuple[dict[str, str], str | None]:
    try:
        from sglang_harden.config import GUARDS, load_config

        config = load_config(environ)
        return {g: config.mode(g).value for g in GUARDS}, None
    except Exception as exc:  # noqa: BLE001 - a bad setting is a finding, not a crash
        return {}, f"{type(exc).__name__}: {exc}"


def build_rows(
    natives: dict[str, P.Native], harden: HardenInfo, launch_args: list[str], environ: dict[str, str]
) -> list[Row]:
    modes, _ = guard_modes(environ)
    if environ.get("SGLANG_HARDEN_ACTIVATE", "").strip() == "0":  # installed but switched off
        modes = dict.fromkeys(modes, "off")
    if control_plane_auth(launch_args, environ, modes) == "unauthenticated":
        modes = {**modes, "bootstrap_auth": "off", "zmq_auth": "off"}  # nothing to check tokens against: not armed
    rows = []
    for prot in P.PROTECTIONS:
        native = natives[prot.key]
        value = switch_value(native.switch, launch_args, environ)
        supplied, active = _guard_state(harden, prot.guard, modes)
        rows.append(
            Row(
                key=prot.key,
                title=prot.title,
                native=native,
                guard=prot.guard,
                supplied=supplied,
                guard_active=active,
                switch=native.switch,
                switch_value=value,
                verdict=_verdict(native, switched_on(native, value), supplied),
            )
        )
    return rows


def _guard_state(harden: HardenInfo, guard: str | None, modes: dict[str, str]) -> tuple[bool | None, bool | None]:
    if guard is None or not harden.available or harden.guards is None:
        return None, None
    state = harden.guards.get(guard)
    if state is None:
        return False, False
    supplied = state["supplied"] and modes.get(guard, "enforce") != "off"
    return supplied, state["active"]


def _verdict(native: P.Native, on: bool | None, supplied: bool | None) -> str:
    if native.status == P.YES and on is not False:
        return "native" + (" + sglang-harden" if supplied else "")
    if native.status == P.OPT_IN and on:
        return "native (switched on)" + (" + sglang-harden" if supplied else "")
    if supplied:
        return "sglang-harden"
    return "MISSING"


# ---------------------------------------------------------------------------------------------- output


def control_plane_auth(launch_args: list[str], environ: dict[str, str], modes: dict[str, str]) -> str:
    """What the bootstrap_auth guard will do on a server started with these settings: its mode when a secret
    file is configured (env or launcher flag), else "unauthenticated"."""
    secret_file = environ.get("SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE") or flag_value(
        launch_args, "--harden-bootstrap-secret-file")
    mode = flag_value(launch_args, "--harden-bootstrap-auth") or modes.get("bootstrap_auth", "off")
    if not secret_file or secret_file == "set" or mode == "off":
        return "unauthenticated"
    return mode


def side_channel_auth(launch_args: list[str], environ: dict[str, str], modes: dict[str, str]) -> str:
    """What the zmq_auth guard will do on the ZMQ rank ports of a server started with these settings (the words of
    ``side_channel_auth`` in ``/server_info``): it needs the control plane's secret file."""
    if control_plane_auth(launch_args, environ, {**modes, "bootstrap_auth": "enforce"}) == "unauthenticated":
        return "unauthenticated"
    mode = flag_value(launch_args, "--harden-zmq-auth") or modes.get("zmq_auth", "off")
    if mode == "off":
        return "unauthenticated"
    sign = flag_value(launch_args, "--harden-zmq-sign") or environ.get("SGLANG_HARDEN_ZMQ_SIGN", "1")
    return mode if sign.strip().lower() in ("1", "true", "yes", "on", "set") else f"{mode} (not signing)"


def _control_plane_state(rows: list[Row], launch_args: list[str], environ: dict[str, str]) -> str:
    """The settings' answer (enforce/log/unauthenticated), but "unauthenticated" whenever nothing in this install
    would check a token (the plugin switched off on a tree without the backport, say)."""
    auth = control_plane_auth(launch_args, environ, guard_modes(environ)[0])
    row = next((r for r in rows if r.key == "bootstrap_auth"), None)
    return "unauthenticated" if row is None or row.missing else auth


def _side_channel_state(rows: list[Row], launch_args: list[str], environ: dict[str, str]) -> str:
    """The settings' answer, but "unauthenticated" where nothing in this install verifies the rank ports."""
    auth = side_channel_auth(launch_args, environ, guard_modes(environ)[0])
    row = next((r for r in rows if r.key == "zmq_auth"), None)
    return "unauthenticated" if row is None or row.missing else auth


def report(tree: SourceTree, launch_args: list[str], environ: dict[str, str]) -> dict:
    version = tree.version()
    natives = P.inspect_tree(tree)
    harden = harden_info(version)
    rows = build_rows(natives, harden, launch_args, environ)
    _, config_error = guard_modes(environ)
    series = series_state(tree.root)
    armed, _ = armed_guards(launch_args, environ)
    shape = shape_state(launch_args, [] if series else armed)  # the series does not carry the gate
    return {
        "sglang": {
            "root": str(tree.root),
            "version": version,
            "family": harden.family if harden.available else None,
            "abort_field": sorted(P.abort_fields(tree)),
        },
        "harden": {**asdict(harden), "config_error": config_error, "digest_kernel": digest_kernel(),
                   "ledger_kernel": ledger_kernel(),
                   "control_plane_auth": _control_plane_state(rows, launch_args, environ),
                   "side_channel_auth": _side_channel_state(rows, launch_args, environ)},
        "series": series,
        "model_shape": shape,
        "protections": [_row_json(r) for r in rows],
        "missing": [r.key for r in rows if r.missing],
        "ok": not any(r.missing for r in rows) and series.get("current", True) and not shape["refused"],
    }


def series_state(root: Path) -> dict:
    """The backport series the tree carries (``{}``: none): the sglang-harden release that generated it, and
    whether it is this one's (an older series lacks what later ones fixed; ``patch verify`` says which patches)."""
    from sglang_harden import __version__
    from sglang_harden.tools.patch import SERIES_STAMP_FILE, tree_series_stamp

    if not (root / SERIES_STAMP_FILE).is_file():
        return {}
    carried = tree_series_stamp(root)
    return {"carried": carried or "unstamped (a series from before series were stamped)", "this_release": __version__,
            "current": carried == __version__}


def digest_kernel() -> dict:
    """Which CPU path the checksum guard's digest takes on this machine (builds the native one if it can)."""
    from sglang_harden.kernels.digest_native import native_status

    built, detail = native_status()
    return {"cpu_path": "native" if built else "torch", "detail": detail}


def ledger_kernel() -> dict:
    """Which path the page ledger's per-transfer operations take on this machine (builds the native one if it can)."""
    from sglang_harden.kernels.ledger_native import native_status

    built, detail = native_status()
    return {"path": "native" if built else "numpy", "detail": detail}


def _row_json(row: Row) -> dict:
    return {
        "key": row.key,
        "title": row.title,
        "native": asdict(row.native),
        "guard": row.guard,
        "supplied_by_harden": row.supplied,
        "guard_active_in_this_process": row.guard_active,
        "switch": row.switch,
        "switch_value": row.switch_value,
        "verdict": row.verdict,
    }


def render_text(data: dict, verbose: bool) -> str:
    sg, hd = data["sglang"], data["harden"]
    lines = [
        f"SGLang {sg['version'] or 'unknown version'} at {sg['root']}",
        f"family: {sg['family'] or 'n/a'}   pending aborts recorded in: {', '.join(sg['abort_field'])}",
    ]
    if not hd["available"]:
        lines.append(hd["note"])
    else:
        supported = {True: "supported", False: "NOT supported", None: "support unknown"}[hd["supported"]]
        lines.append(f"sglang-harden compat: pin {hd['pin']} family {hd['family']} ({supported})")
        if hd["note"]:
            lines.append(hd["note"])
    if hd.get("config_error"):
        lines.append(f"sglang-harden config error: {hd['config_error']}")
    auth = hd.get("control_plane_auth")
    if auth == "unauthenticated":
        lines.append("PD control plane: UNAUTHENTICATED (no --harden-bootstrap-secret-file; docs/security.md)")
    elif auth:
        lines.append(f"PD control plane: authenticated ({auth})")
    side = hd.get("side_channel_auth")
    if side == "unauthenticated":
        lines.append("PD ZMQ side channels: UNAUTHENTICATED (anyone reaching a rank port can register where KV goes;"
                     " docs/security.md)")
    elif side:
        lines.append(f"PD ZMQ side channels: authenticated ({side})")
    series = data.get("series") or {}
    if series:
        state = "this release's" if series["current"] else (
            f"NOT this release's ({series['this_release']}): re-apply it to a clean tree, `sglang-harden patch verify`")
        lines.append(f"backport series: generated by sglang-harden {series['carried']}, {state}")
    shape = data.get("model_shape") or {}
    if shape.get("refused"):
        lines.append(f"model shape: the node would REFUSE to start: {shape['message']}")
    elif shape:
        kinds = ", ".join(shape["shapes"]) + ("" if shape["known"] else " (attention kind not read)")
        lines.append(f"model shape: {kinds} ({'; '.join(shape['read_from'])})")
    kernel = hd.get("digest_kernel")
    if kernel:
        lines.append(f"checksum digest on CPU tensors: {kernel['cpu_path']} ({kernel['detail']})")
    rows = []
    for p in data["protections"]:
        supplied = _yes_no(p["supplied_by_harden"], p["guard"])
        switch = f"{p['switch']}={p['switch_value']}" if p["switch"] and p["switch_value"] else p["switch"]
        rows.append([p["title"], _native_cell(p["native"]), supplied, switch or "-", p["verdict"]])
    lines += ["", table(["protection", "native (from code)", "sglang-harden", "switch", "verdict"], rows, 64)]
    if verbose:
        lines.append("")
        for p in data["protections"]:
            lines.append(f"{p['key']}:")
            lines += [f"    {e}" for e in p["native"]["evidence"]] or ["    (no code found)"]
    missing = data["missing"] + ([] if series.get("current", True) else ["backport series of this release"]) + (
        [f"model shape ({', '.join(shape['refused'])} refused)"] if shape.get("refused") else [])
    lines += ["", "OK: every protection is covered" if not missing else f"MISSING: {', '.join(missing)}"]
    return "\n".join(lines)


def _native_cell(native: dict) -> str:
    return f"{native['status']}: {native['detail']}"


def _yes_no(value: bool | None, guard: str | None) -> str:
    if value is None:
        return "n/a"
    return f"yes ({guard})" if value else "no"


def run(args: argparse.Namespace) -> int:
    if args.matrix:
        return _print_matrix(args.results)
    try:
        tree = SourceTree(args.sglang_root) if args.sglang_root else SourceTree.installed()
    except (FileNotFoundError, OSError) as exc:
        print(f"doctor: {exc}")
        return EXIT_NO_SGLANG
    if tree is None:
        print("doctor: SGLang is not importable here; pass --sglang-root DIR (a tree containing sglang/)")
        return EXIT_NO_SGLANG
    try:
        launch_args = shlex.split(args.launch_args or "")
    except ValueError as exc:
        print(f"doctor: --launch-args: {exc}")
        return EXIT_NO_SGLANG
    data = report(tree, launch_args, dict(os.environ))
    print(dump_json(data) if args.json else render_text(data, args.verbose))
    return EXIT_OK if data["ok"] else EXIT_MISSING


def _print_matrix(results: Path) -> int:
    from sglang_harden.tools import matrix
    from sglang_harden.tools.patch import default_patches_dir

    if not results.is_dir():
        print(f"doctor --matrix: no results directory {results} (run scripts/matrix.sh, or pass --results DIR)")
        return EXIT_NO_SGLANG
    try:
        cells = matrix.load(results)
        stale = matrix.stale_notes(results)
    except ValueError as exc:
        print(f"doctor --matrix: {exc}")
        return EXIT_NO_SGLANG
    print(matrix.document(cells, default_patches_dir(), str(results), stale), end="")
    return EXIT_OK
