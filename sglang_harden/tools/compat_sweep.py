"""``sglang-harden compat sweep``: judge SGLang releases against the plugin's hooks, reading their code only.

    sglang-harden compat sweep                              # every final release from 0.4.4.post2 on the index
    sglang-harden compat sweep --from 0.5.15 --to 0.5.23 --json
    sglang-harden compat sweep --releases 0.5.19,0.5.23 --offline   # trees already here (pin venvs, cache)

For each release (source from ``tools/_wheels``: nothing is installed or imported) and each adapter family
under ``sglang_harden/compat``, every hook target is looked up statically: the module, the class (bases
included) and the function, and its leading parameter names against the ones the hook expects. Per guard:

- ``hookable``: every hook the guard needs resolves, on the Mooncake backend at least (NIXL, MORI listed when
  they too; a backend the release has whose hooks do not resolve is named as lacking);
- ``needs a patch``: some target is missing or changed shape (listed); the plugin refuses such a release;
- ``impossible``: the release has no PD disaggregation at all.

The default range starts at 0.4.4.post2, the first release with PD disaggregation (``sglang/srt/disaggregation/``
with its prefill and decode scheduler paths; through 0.4.5 its KV transfer is a placeholder, Mooncake came with
0.4.5.post1 and NIXL with 0.4.5.post3): older releases are out of scope. Every release also gets its protection
from ``compat.reach``: ``plugin + series``, ``series``, ``plugin`` or ``none``, and for ``none`` the next step (the
nearest protected releases on either side).

Optional targets (hooks some releases of a family have) are reported as found or not. Doctor's detectors
say which upstream protections the release has. ``e2e`` marks the releases the plugin supports today (tested
end to end on CPU); a release can be hookable and still unsupported until its e2e passes.
Exit code: 0 when every release was judged, 1 when some could not be fetched, 2 on bad input.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from sglang_harden.compat.backends import BACKEND_MODULES
from sglang_harden.compat.hooks import PAGE_LEDGER_OWNER, Hook
from sglang_harden.compat.internals import CONN, PD
from sglang_harden.compat.reach import next_step, reach_of
from sglang_harden.config import GUARDS

FAMILIES = ("sglang_v05", "sglang_v049")
PD_PACKAGE = PD
# The first release with PD disaggregation (sglang/srt/disaggregation/, read from the wheels of 0.4.4-0.4.9): every
# release before it has nothing the plugin could guard.
FIRST_PD_RELEASE = "0.4.4.post2"
DEFAULT_FROM = FIRST_PD_RELEASE
HOOKABLE, NEEDS_PATCH, IMPOSSIBLE = "hookable", "needs a patch", "impossible"
NOT_IN_ADAPTER = "the {} adapter has no hooks for this guard"
# "startup" is not a guard: its hooks (scheduler start, state report) are what lets the plugin run at all.
OWNERS = ("startup", *GUARDS)
# Hook owners that are part of a guard: page_tags alone needs the hooks that keep decode's page ledger.
OWNED_BY = {"page_tags": ("page_tags", PAGE_LEDGER_OWNER)}
# Guards whose hooks also need a module-level name in place (the signing client replaces `requests` there).
NEEDS_REQUESTS_IN = {"bootstrap_auth": CONN}


@dataclass
class GuardVerdict:
    verdict: str
    backends: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    # backends the release has whose hooks for this guard do not resolve (the guard refuses to start on them)
    lacking: list[str] = field(default_factory=list)
    # the family does not fit this release at all (family_mismatch), whatever its hooks resolve to
    misfit: bool = False


PLUGIN_AND_SERIES, SERIES, PLUGIN, UNPROTECTED = "plugin + series", "series", "plugin", "none"


@dataclass
class Protection:
    """What protects a release (``compat.reach``): the plugin, a backport series, both, or none; for ``none`` the
    nearest protected releases on either side ("0.5.18 (series)") and the next step an operator reads."""

    verdict: str
    older: str | None = None
    newer: str | None = None
    next_step: str = ""


def protection_of(release: str, series_pins: Iterable[str]) -> Protection:
    """``release``'s protection; ``series_pins``: the releases with a backport series (``patch.available_pins``)."""
    series = list(series_pins)
    reach = reach_of(release, series)
    verdict = {(True, True): PLUGIN_AND_SERIES, (False, True): SERIES, (True, False): PLUGIN,
               (False, False): UNPROTECTED}[(reach.plugin, reach.series)]
    if verdict != UNPROTECTED:
        return Protection(verdict)
    return Protection(verdict, reach.older, reach.newer, next_step(release, series))


def series_pins_here() -> list[str]:
    """The releases this checkout (or wheel) has a backport series for."""
    from sglang_harden.tools.patch import available_pins, default_patches_dir

    return available_pins(default_patches_dir())


@dataclass
class ReleaseReport:
    release: str
    e2e_supported: bool
    protection: Protection | None = None
    adapter: str | None = None
    guards: dict[str, GuardVerdict] = field(default_factory=dict)
    optional: dict[str, bool] = field(default_factory=dict)
    protections: dict[str, str] = field(default_factory=dict)
    other_adapters: dict[str, list[str]] = field(default_factory=dict)  # adapter -> what it misses here
    error: str | None = None


def family_hooks(name: str) -> tuple[list[Hook], list[Hook]]:
    """(hooks every release of the family needs, hooks only some have) for adapter module ``name``."""
    module = importlib.import_module(f"sglang_harden.compat.{name}")
    optional = list(getattr(module, "OPTIONAL_HOOKS", []))
    optional_keys = {(h.target, h.owner) for h in optional}
    return [h for h in module.HOOKS if (h.target, h.owner) not in optional_keys], optional


def parameter_names(node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    """Names in the order ``inspect.signature`` lists them."""
    args = node.args
    names = [a.arg for a in [*args.posonlyargs, *args.args]]
    if args.vararg is not None:
        names.append(args.vararg.arg)
    names.extend(a.arg for a in args.kwonlyargs)
    if args.kwarg is not None:
        names.append(args.kwarg.arg)
    return tuple(names)


def hook_problem(tree: Any, hook: Hook) -> str | None:
    """Why ``hook`` cannot be installed on ``tree`` (a SourceTree), or None when it can."""
    if not tree.exists(hook.module):
        return f"{hook.target}: module missing"
    ref = _find(tree, hook.module, hook.qualname)
    if ref is None:
        return f"{hook.target}: not found"
    found = parameter_names(ref.node)
    if found[: len(hook.params)] != hook.params:
        return f"{hook.target}: parameters {found}, expected {hook.params} first"
    return None


def _find(tree: Any, module: str, qualname: str) -> Any:
    """The function ``module.qualname`` names, also when ``module`` imported it (or its class) from elsewhere
    in SGLang (a hook then wraps the module's own binding of that name)."""
    ref = tree.function(module, qualname)
    if ref is not None:
        return ref
    head, _, rest = qualname.partition(".")
    located = tree.resolve_name(module, head)
    if located is None or located == (module, head):
        return None
    return tree.function(located[0], f"{located[1]}.{rest}" if rest else located[1])


def judge_guard(tree: Any, guard: str, hooks: list[Hook]) -> GuardVerdict:
    mine = [h for h in hooks if h.owner in OWNED_BY.get(guard, (guard,))]
    core = [p for h in mine if h.module not in BACKEND_MODULES.values() and (p := hook_problem(tree, h))]
    needs_requests = NEEDS_REQUESTS_IN.get(guard)
    if needs_requests and "import requests" not in tree.text(needs_requests):
        core.append(f"{needs_requests}: does not import requests (the signing client replaces that name)")
    by_backend = {name: [p for h in mine if h.module == module and (p := hook_problem(tree, h))]
                  for name, module in BACKEND_MODULES.items()}
    backends = [name for name, module in BACKEND_MODULES.items() if tree.exists(module) and not by_backend[name]]
    lacking = [name for name, module in BACKEND_MODULES.items() if tree.exists(module) and by_backend[name]]
    if not core and "mooncake" in backends:
        return GuardVerdict(HOOKABLE, backends, lacking=lacking)
    mooncake = by_backend["mooncake"] or ([] if tree.exists(BACKEND_MODULES["mooncake"]) else
                                          [f"{BACKEND_MODULES['mooncake']}: module missing"])
    return GuardVerdict(NEEDS_PATCH, backends, core + mooncake)


# A family's hooks resolving is not enough where the family was written against a different generation of SGLang's
# request handling: the 0.4.9 adapter's hooks resolve on 0.5.5-0.5.18, but on 0.5.18 its coverage read 0 tokens for
# every transfer and its abort path called a moved method (measured). It fits releases that record a pending abort in
# ``finished_reason`` (``to_finish`` came with 0.5.4.post2, together with those changes).
V049_MISMATCH = ("the sglang_v049 adapter was written for releases that record a pending abort in finished_reason; "
                 "this one uses to_finish (its metadata and streaming differ too)")


def family_mismatch(tree: Any, name: str) -> str | None:
    """Why family ``name`` does not fit the release at all, whatever its hooks resolve to; None: it may."""
    from sglang_harden.tools._detect_base import abort_fields

    if name == "sglang_v049" and "to_finish" in abort_fields(tree):
        return V049_MISMATCH
    return None


def judge_family(tree: Any, name: str) -> tuple[dict[str, GuardVerdict], dict[str, bool]]:
    required, optional = family_hooks(name)
    mismatch = family_mismatch(tree, name)
    if mismatch is not None:
        owners = [owner for owner in OWNERS if any(h.owner == owner for h in required)]
        return {owner: GuardVerdict(NEEDS_PATCH, missing=[mismatch], misfit=True) for owner in owners}, {
            f"{h.owner}: {h.target}": False for h in optional}
    verdicts = {owner: judge_guard(tree, owner, required) for owner in OWNERS if any(h.owner == owner
                                                                                       for h in required)}
    found = {f"{h.owner}: {h.target}": hook_problem(tree, h) is None for h in optional}
    return verdicts, found


def judge_release(release: str, tree: Any, supported: dict[str, str],
                  series_pins: Iterable[str] | None = None) -> ReleaseReport:
    """``series_pins``: the releases with a backport series (default: this checkout's, ``series_pins_here``)."""
    from sglang_harden.tools import _protections

    report = ReleaseReport(release, release in supported, protection_of(
        release, series_pins_here() if series_pins is None else series_pins))
    if not tree.exists(PD_PACKAGE):
        report.guards = {g: GuardVerdict(IMPOSSIBLE, missing=["no PD disaggregation in this release"])
                         for g in OWNERS}
        return report
    judged = {name: judge_family(tree, name) for name in FAMILIES}
    report.adapter, best = _choose({name: verdicts for name, (verdicts, _) in judged.items()})
    verdicts, report.optional = judged[best]
    report.guards = {g: verdicts.get(g, GuardVerdict(NEEDS_PATCH, missing=[NOT_IN_ADAPTER.format(best)]))
                     for g in OWNERS}
    report.other_adapters = {name: sorted({p for v in judged[name][0].values() for p in v.missing})
                             for name in FAMILIES if name != best}
    report.protections = {key: native.status for key, native in _protections.inspect_tree(tree).items()}
    return report


def choose_family(tree: Any) -> tuple[str | None, str, list[str]]:
    """(the family whose every guard is hookable on ``tree``, or None; the one to use: that, else the family with
    the fewest problems; what the one to use misses). The plugin takes its adapter for an unknown release from
    here, so it and the sweep agree."""
    judged = {name: judge_family(tree, name)[0] for name in FAMILIES}
    fitting, best = _choose(judged)
    return fitting, best, sorted({p for v in judged[best].values() for p in v.missing})


def _choose(judged: dict[str, dict[str, GuardVerdict]]) -> tuple[str | None, str]:
    fitting = next((name for name in FAMILIES if _fits(judged[name])), None)
    return fitting, fitting or min(FAMILIES, key=lambda name: _problems(judged[name]))


def _fits(verdicts: dict[str, GuardVerdict]) -> bool:
    return all(v.verdict == HOOKABLE for v in verdicts.values())


def _problems(verdicts: dict[str, GuardVerdict]) -> tuple[bool, int]:
    """A family that does not fit the release at all ranks after every family that merely misses hooks."""
    return any(v.misfit for v in verdicts.values()), sum(len(v.missing) for v in verdicts.values())


# ---------------------------------------------------------------- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("sweep",))
    parser.add_argument("--from", dest="first", default=DEFAULT_FROM, help=f"oldest release (default {DEFAULT_FROM})")
    parser.add_argument("--to", dest="last", default=None, help="newest release (default: the newest on the index)")
    parser.add_argument("--releases", default=None, help="comma-separated releases instead of a range")
    parser.add_argument("--offline", action="store_true", help="only trees already here (pin venvs, wheel cache)")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="machine-readable output")
    output.add_argument("--markdown", action="store_true", help="a Markdown table (docs/support.md)")


def run(args: argparse.Namespace) -> int:
    from sglang_harden.compat.pins import SUPPORTED_PINS
    from sglang_harden.tools import _wheels
    from sglang_harden.tools._source import SourceTree

    try:
        releases = _choose_releases(args)
    except (ValueError, _wheels.ReleaseUnavailable) as exc:
        print(f"sglang-harden compat: {exc}", file=sys.stderr)
        return 2
    series = series_pins_here()
    reports = []
    for release in releases:
        print(f"sglang-harden compat: judging {release}", file=sys.stderr)
        try:
            tree = SourceTree(_wheels.release_tree(release, download=not args.offline))
        except (_wheels.ReleaseUnavailable, FileNotFoundError) as exc:
            reports.append(ReleaseReport(release, release in SUPPORTED_PINS, protection_of(release, series),
                                         error=str(exc)))
            continue
        reports.append(judge_release(release, tree, SUPPORTED_PINS, series))
    if args.json:
        print(json.dumps([asdict(r) for r in reports], indent=2))
    else:
        print(render_markdown(reports) if args.markdown else render(reports))
    return 1 if any(r.error for r in reports) else 0


def _choose_releases(args: argparse.Namespace) -> list[str]:
    from sglang_harden.compat.pins import release_key
    from sglang_harden.tools._wheels import index_releases

    if args.releases:
        chosen = [r.strip() for r in args.releases.split(",") if r.strip()]
        for release in chosen:
            release_key(release)
        return sorted(chosen, key=release_key)
    first = release_key(args.first)
    last = release_key(args.last) if args.last else None
    return [r for r in index_releases() if release_key(r) >= first and (last is None or release_key(r) <= last)]


CELL = {HOOKABLE: "hook", NEEDS_PATCH: "PATCH", IMPOSSIBLE: "-"}


def render(reports: list[ReleaseReport]) -> str:
    rows, notes = _rows(reports)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return "\n".join([*lines, "", LEGEND, "", tally(reports),
                      *(["", "why:"] + [f"  {n}" for n in notes] if notes else [])])


def render_markdown(reports: list[ReleaseReport]) -> str:
    """docs/support.md: its header, the table (a ``markdown_row`` per report), the tally of protections, Why."""
    rows, notes = _rows(reports)
    table = [f"| {' | '.join(rows[0])} |", f"|{'---|' * len(rows[0])}"]
    table += [f"| {' | '.join(row)} |" for row in rows[1:]]  # = markdown_row of each report
    why = [f"- {n}" for n in notes]
    return "\n".join([*markdown_header(reports), "", *table, "", LEGEND, "", tally(reports),
                      *(["", "Why:", "", *why] if why else [])])


def markdown_header(reports: list[ReleaseReport]) -> list[str]:
    """The title and the paragraph above the table (wrapped as docs/support.md keeps it)."""
    import textwrap

    span = f"from {reports[0].release} to {reports[-1].release}" if reports else "(none asked for)"
    series_only = [r.release for r in reports if r.protection is not None and r.protection.verdict == SERIES]
    text = (
        f"Generated by `sglang-harden compat sweep --markdown` (every final SGLang release {span} on the package "
        f"index, read statically: nothing installed or imported). {FIRST_PD_RELEASE} is the first release with PD "
        "disaggregation (`sglang/srt/disaggregation/`, read from the wheels): releases before it are out of scope, "
        "there is nothing in them to guard; through 0.4.5 its KV transfer is a placeholder (Mooncake came with "
        "0.4.5.post1, NIXL with 0.4.5.post3). `e2e` marks the pins the plugin supports today, each tested end to "
        "end on CPU in CI or by its pin suite. A release outside them is refused at start-up even when every hook "
        "resolves, until its e2e passes (override: `SGLANG_HARDEN_ALLOW_UNKNOWN_PIN=1`, which takes the adapter this "
        "table names for the release: the family whose hooks all resolve on its code, else the one with the fewest "
        "gaps). Adapter `none`: no family fits; the cells are the closest family's. The 0.4.9 family fits only "
        "releases that record a pending abort in `finished_reason` (to 0.5.4.post1): on 0.5.18 its hooks resolved "
        "but it did not work (measured). `protected by` says what protects each release: the plugin (a supported "
        "pin), a backport series (`patches/`, see `docs/matrix.md`), both, or none; for `none` it names the "
        "nearest protected releases on either side, and Why gives the next step."
        + (f" Protected by their series only (the plugin refuses them): {', '.join(series_only)}."
           if series_only else ""))
    return ["# Support matrix (generated)", "", *textwrap.wrap(text, 115, break_on_hyphens=False)]


def tally(reports: list[ReleaseReport]) -> str:
    """One line: how many releases each protection verdict covers."""
    verdicts = [r.protection.verdict for r in reports if r.protection is not None]
    counts = ", ".join(f"{verdicts.count(v)} {v}" for v in (PLUGIN_AND_SERIES, SERIES, PLUGIN, UNPROTECTED))
    return f"Protection: {len(reports)} releases: {counts}."


def protection_cell(protection: Protection | None) -> str:
    """``plugin + series``, ``series``, ``plugin``, or ``none → <older> / <newer>`` (the nearest protected)."""
    if protection is None:
        return "?"
    if protection.verdict != UNPROTECTED:
        return protection.verdict
    older, newer = (side or "-" for side in (protection.older, protection.newer))
    return f"{UNPROTECTED} → {older} / {newer}"


LEGEND = ("hook: every hook the guard needs resolves, read statically (Mooncake; NIXL and, from 0.5.9, MORI too "
          "unless '(no nixl)'/'(no mori)' says the guard refuses to start on that backend); PATCH: a "
          "target is missing or moved, or the adapter has none; -: no PD disaggregation; e2e: a supported pin, its "
          "guards proven end to end on CPU (elsewhere 'hook' says the code fits, not that the guard works); "
          "protected by: plugin, series (a backport series), both, or 'none → older / newer', the nearest protected "
          "releases on either side ('-': none that side)")


def markdown_row(report: ReleaseReport) -> str:
    """The release's line of the Markdown table (docs/support.md)."""
    return f"| {' | '.join(_rows([report])[0][1])} |"


def _rows(reports: list[ReleaseReport]) -> tuple[list[list[str]], list[str]]:
    guards = list(OWNERS)
    header = ["release", "e2e", "protected by", "adapter", *guards]
    rows = [header]
    notes: list[str] = []
    for r in reports:
        e2e, protected = "yes" if r.e2e_supported else "", protection_cell(r.protection)
        if r.protection is not None and r.protection.next_step:
            notes.append(f"{r.release}: {r.protection.next_step}")
        if r.error:
            rows.append([r.release, e2e, protected, "?", *["?"] * len(guards)])
            notes.append(f"{r.release}: {r.error}")
            continue
        cells = []
        for g in guards:
            verdict = r.guards[g]
            cell = CELL[verdict.verdict]
            if verdict.verdict == HOOKABLE:
                cell += "".join(f" (no {name})" for name in verdict.lacking)
            cells.append(cell)
        rows.append([r.release, e2e, protected, r.adapter or "none", *cells])
        absent_guards = [g for g in guards if r.guards[g].missing == [NOT_IN_ADAPTER.format(r.adapter)]]
        if absent_guards:
            notes.append(f"{r.release}: the {r.adapter} adapter has no hooks for {', '.join(absent_guards)}")
        for g in guards:
            if g not in absent_guards:
                notes.extend(f"{r.release} {g}: {problem}" for problem in r.guards[g].missing[:3])
        for name, missing in r.other_adapters.items():
            if missing and r.adapter is not None:
                notes.append(f"{r.release}: the {name} adapter would miss {len(missing)} target(s): "
                             + ", ".join(m.split(":")[0].rsplit(".", 1)[-1] for m in missing[:6])
                             + (", ..." if len(missing) > 6 else ""))
        absent = [target for target, found in r.optional.items() if not found]
        if r.optional:
            notes.append(f"{r.release} optional targets found: {len(r.optional) - len(absent)}/{len(r.optional)}"
                         + (f" (absent: {', '.join(absent)})" if absent else ""))
    return rows, notes
