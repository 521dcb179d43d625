"""The guard x pin x path matrix, built from what was run: ``sglang-harden doctor --matrix [--results DIR]``.

Each end-to-end test that proves a guard says so (``@pytest.mark.proves(path, guard, ...)``, ``path``: ``plugin``
or ``patch``). With ``SGLANG_HARDEN_MATRIX_RESULTS=DIR`` set, the test suite appends one JSON line per such test
and pin to ``DIR/<pin>.jsonl``: ``{"test", "pin", "path", "guards", "outcome"}`` (``scripts/matrix.sh`` runs the
e2e of every supported pin that way). The matrix reads those lines and says per pin, guard and path:

- ``e2e``: a test proving it passed on that pin, none failed;
- ``FAILED``: one failed;
- ``static``: no result, but the path has it (the plugin's adapter hooks the guard; the pin's patch series has a
  patch for it), checked without running a server;
- ``upstream``: no result, no patch, but a patched tree has it because SGLang itself does (:data:`UPSTREAM`);
- ``-``: the path does not give it on that pin.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from sglang_harden.compat.pins import SUPPORTED_PINS
from sglang_harden.config import GUARDS
from sglang_harden.tools._wheels import release_key

PATHS = ("plugin", "patch")
COLUMNS = (*GUARDS, "capacity")
# a backport patch's name (after its number) -> the guard(s) it gives
PATCH_GUARDS: dict[str, str | tuple[str, ...]] = {
    "admission-at-both-doors": "admission",
    "retire-before-final-send": "retire",
    "coverage-publish-and-check": "coverage",
    "notify-decode-of-prefill-rejections": "abort_notify",
    "capacity-gate": "capacity",
    "authenticate-control-plane": "bootstrap_auth",
    "page-ownership-tags": "page_tags",
    "kv-canary": "canary",
    "page-lifecycle": "lifecycle",
    "kv-digest": "checksum",
    "authenticate-side-channels": ("zmq_auth", "side_channels"),
}
# Guards upstream SGLang has itself (on by default) from a release on: (doctor's protection key, first release).
# tests/integration/test_doctor_wheels.py checks each supported pin's code agrees.
UPSTREAM = {"admission": ("door_rejection", "0.5.21"), "retire": ("abort_retirement", "0.5.20")}
ENV = "SGLANG_HARDEN_MATRIX_RESULTS"
Key = tuple[str, str, str]  # (pin, path, guard)


def record(results_dir: Path, test: str, pin: str, path: str, guards: Iterable[str], outcome: str) -> None:
    """One test's result, appended to its pin's file (a single short write: safe from several workers)."""
    if path not in PATHS:
        raise ValueError(f"matrix path {path!r}: one of {PATHS}")
    unknown = sorted(set(guards) - set(COLUMNS))
    if unknown:
        raise ValueError(f"matrix guards {unknown}: not among {COLUMNS}")
    results_dir.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"test": test, "pin": pin, "path": path, "guards": sorted(guards), "outcome": outcome})
    with open(results_dir / f"{pin}.jsonl", "a", encoding="utf-8") as out:
        out.write(line + "\n")


def load(results_dir: Path) -> dict[Key, str]:
    """``(pin, path, guard) -> "e2e" | "FAILED"`` from every results file (a failure anywhere wins)."""
    cells: dict[Key, str] = {}
    for path in sorted(results_dir.glob("*.jsonl")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                keys = [(entry["pin"], entry["path"], guard) for guard in entry["guards"]]
                outcome = entry["outcome"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a matrix result ({exc})") from exc
            for key in keys:
                if outcome == "failed" or cells.get(key) == "FAILED":
                    cells[key] = "FAILED"
                elif outcome == "passed":
                    cells[key] = "e2e"
    return cells


def plugin_guards(pin: str) -> set[str]:
    """The guards the plugin's adapter for ``pin`` hooks (and the start-up capacity gate, which every one has); none
    for a release the plugin refuses (one with a patch series only)."""
    import importlib

    if pin not in SUPPORTED_PINS:
        return set()

    family = importlib.import_module(f"sglang_harden.compat.{SUPPORTED_PINS[pin]}")
    return ({hook.owner for hook in family.HOOKS} & set(GUARDS)) | {"capacity"}


def patch_guards(pin: str, patches_dir: Path) -> set[str]:
    from sglang_harden.tools.patch import PatchError, load_series

    try:
        series = load_series(pin, patches_dir)
    except PatchError:
        return set()
    names = [patch.name.split("-", 1)[1].removesuffix(".patch") for patch in series]
    given = [PATCH_GUARDS[name] for name in names if name in PATCH_GUARDS]
    return {guard for guards in given for guard in ((guards,) if isinstance(guards, str) else guards)}


def render(cells: dict[Key, str], patches_dir: Path) -> str:
    """The matrix as Markdown: a row per supported pin and per release with a patch series, a cell per guard,
    ``plugin / patch`` in each."""
    header = ["pin", *COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for pin in matrix_pins(patches_dir):
        static = {"plugin": plugin_guards(pin), "patch": patch_guards(pin, patches_dir)}
        row = [pin]
        for guard in COLUMNS:
            row.append(" / ".join(cells.get((pin, path, guard)) or _static_cell(pin, path, guard, static[path])
                                  for path in PATHS))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def matrix_pins(patches_dir: Path) -> list[str]:
    """The plugin's supported pins and the releases with a backport series, oldest first."""
    from sglang_harden.tools.patch import available_pins

    return sorted(set(SUPPORTED_PINS) | set(available_pins(patches_dir)), key=release_key)


def upstream_has(pin: str, guard: str) -> bool:
    return guard in UPSTREAM and release_key(pin) >= release_key(UPSTREAM[guard][1])


def _static_cell(pin: str, path: str, guard: str, has: set[str]) -> str:
    if guard in has:
        return "static"
    return "upstream" if path == "patch" and upstream_has(pin, guard) else "-"


def document(cells: dict[Key, str], patches_dir: Path, results_label: str) -> str:
    """docs/matrix.md: what the cells mean, which pins have results, the table."""
    run = sorted({pin for pin, _, _ in cells}, key=release_key)
    return "\n".join([
        "# Guard x pin x path matrix (generated)",
        "",
        f"Generated by `sglang-harden doctor --matrix` from the end-to-end results in `{results_label}`, which",
        "`scripts/matrix.sh` writes (CI's two pins, or every supported pin). Each cell is `plugin / patch`: **e2e** a",
        "test proving the guard on that path passed on that pin (real prefill and decode servers on CPU), **FAILED**",
        "one failed, **static** the path has the guard (the plugin's adapter hooks it, or the pin's series has a",
        "patch for it) but no e2e result is here, **upstream** no patch is needed (SGLang has it itself), **-** the",
        "path does not give it (a release with a patch series only: the plugin refuses to start on it). The patch",
        "path is a patched tree with the plugin uninstalled.",
        "",
        f"Pins with results: {', '.join(run) if run else 'none'}.",
        "",
        render(cells, patches_dir),
        "",
    ])


README_BEGIN, README_END = "<!-- matrix:begin (generated: scripts/matrix.sh) -->", "<!-- matrix:end -->"


def readme_block(cells: dict[Key, str], patches_dir: Path) -> str:
    return f"{README_BEGIN}\n{render(cells, patches_dir)}\n{README_END}"


def write_docs(results_dir: Path, repo: Path) -> None:
    """Rewrite docs/matrix.md and README's matrix block from ``results_dir``."""
    cells = load(results_dir)
    patches = repo / "patches"
    label = str(results_dir.resolve().relative_to(repo.resolve())) if results_dir.resolve().is_relative_to(
        repo.resolve()) else str(results_dir)
    (repo / "docs" / "matrix.md").write_text(document(cells, patches, label))
    readme = repo / "README.md"
    text = readme.read_text()
    start, end = text.index(README_BEGIN), text.index(README_END) + len(README_END)
    readme.write_text(text[:start] + readme_block(cells, patches) + text[end:])
