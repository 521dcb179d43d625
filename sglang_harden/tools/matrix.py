"""The guard x pin x path matrix, built from what was run: ``sglang-harden doctor --matrix [--results DIR]``.

Each end-to-end test that proves a guard says so (``@pytest.mark.proves(path, guard, ...)``, ``path``: ``plugin``
or ``patch``). With ``SGLANG_HARDEN_MATRIX_RESULTS=DIR`` set, the test suite appends one JSON line per test of a
proving module and pin to ``DIR/<pin>.jsonl``: ``{"test", "module", "pin", "path", "guards", "outcome", "code",
"date"}``, where ``code`` is :func:`code_hash` of what the test ran (the plugin and testbed package, the testbed
recipes, the pin's patch series, the test module and the suite's conftest) and a test of the module that proves
nothing itself (a vanilla control, an evidence check) has ``path`` ``control`` and no guards (``scripts/matrix.sh``
runs the e2e of every stale pin that way). The matrix reads those lines and says per pin, guard and path:

- ``e2e``: a test proving it passed on that pin with today's code, and none of that code's results for it (nor a
  control of a module that proves it) failed;
- ``FAILED``: one of today's code's failed;
- ``stale``: results exist, none ran today's code (:func:`stale_notes` says which, when and what ran);
- ``static``: no result, but the path has it (the plugin's adapter hooks the guard; the pin's patch series has a
  patch for it), checked without running a server;
- ``upstream``: no result, no patch, but a patched tree has it because SGLang itself does (:data:`UPSTREAM`);
- ``-``: the path does not give it on that pin.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from sglang_harden.compat.pins import SUPPORTED_PINS, release_key
from sglang_harden.config import GUARDS

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
CONTROL = "control"  # the path of a result whose test proves nothing itself (a vanilla control, an evidence check)
REPO = Path(__file__).resolve().parents[2]
Key = tuple[str, str, str]  # (pin, path, guard)
Hasher = Callable[[str, str], str]  # (pin, test module path relative to the repo) -> code hash


def code_hash(pin: str, module: str, repo: Path = REPO) -> str:
    """SHA-256 (first 16 hex digits) of the code a result of ``module`` on ``pin`` depends on: the
    ``sglang_harden`` package (guards, compat, testbed and its shims), ``ci/pins.toml`` (the testbed recipes),
    ``patches/<pin>/``, ``tests/conftest.py`` and the test module itself. Docs, README and other pins' series
    do not count."""
    digest = hashlib.sha256(_package_hash(repo).encode())
    for path in [repo / "tests" / "conftest.py", repo / module, *sorted((repo / "patches" / pin).glob("*.patch"))]:
        digest.update(f"\0{path.relative_to(repo).as_posix()}\0".encode())
        digest.update(path.read_bytes() if path.is_file() else b"<absent>")
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=4)
def _package_hash(repo: Path) -> str:
    digest = hashlib.sha256()
    files = [p for p in (repo / "sglang_harden").rglob("*") if p.is_file() and "__pycache__" not in p.parts
             and p.suffix not in (".pyc", ".so")]
    for path in sorted([*files, repo / "ci" / "pins.toml"]):
        digest.update(f"\0{path.relative_to(repo).as_posix()}\0".encode())
        digest.update(path.read_bytes() if path.is_file() else b"<absent>")
    return digest.hexdigest()


def module_of(test: str) -> str:
    """The test module path of a pytest node id (``tests/e2e/x.py::test_y[...]`` -> ``tests/e2e/x.py``)."""
    return test.split("::", 1)[0]


def record(results_dir: Path, test: str, pin: str, path: str, guards: Iterable[str], outcome: str,
           code: str, date: str | None = None, control: str = "") -> None:
    """One test's result, appended to its pin's file (a single short write: safe from several workers)."""
    if path not in (*PATHS, CONTROL):
        raise ValueError(f"matrix path {path!r}: one of {(*PATHS, CONTROL)}")
    unknown = sorted(set(guards) - set(COLUMNS))
    if unknown:
        raise ValueError(f"matrix guards {unknown}: not among {COLUMNS}")
    if (path == CONTROL) != (not list(guards)):
        raise ValueError(f"matrix result of {test}: a {CONTROL} result names no guards, a proving one names some")
    results_dir.mkdir(parents=True, exist_ok=True)
    line = json.dumps({"test": test, "module": module_of(test), "pin": pin, "path": path, "guards": sorted(guards),
                       "outcome": outcome, "code": code, "control": control,
                       "date": date or time.strftime("%Y-%m-%d", time.gmtime())})
    with open(results_dir / f"{pin}.jsonl", "a", encoding="utf-8") as out:
        out.write(line + "\n")


@dataclass(frozen=True)
class Result:
    test: str
    module: str
    pin: str
    path: str
    guards: tuple[str, ...]
    outcome: str
    code: str  # "" for a result written before results carried their code's hash
    date: str
    control: str = ""  # a proof's negative control: "self", "test_x" (same module) or "tests/.../m.py::test_x"

    def control_id(self) -> tuple[str, str] | None:
        """(module, test function) of the proof's separate control; None for "self" or a control result."""
        if self.path == CONTROL or self.control in ("", "self"):
            return None
        module, _, name = self.control.rpartition("::")
        return module or self.module, name

    def function(self) -> str:
        return self.test.split("::", 1)[1].split("[", 1)[0].split("@", 1)[0] if "::" in self.test else self.test


def read_results(results_dir: Path) -> list[Result]:
    """Every result line of ``results_dir/*.jsonl`` (ValueError naming the file and line of a malformed one)."""
    results = []
    for path in sorted(results_dir.glob("*.jsonl")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                results.append(Result(entry["test"], entry.get("module") or module_of(entry["test"]), entry["pin"],
                                      entry["path"], tuple(entry["guards"]), entry["outcome"], entry.get("code", ""),
                                      entry.get("date", ""), entry.get("control", "")))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ValueError(f"{path}:{number}: not a matrix result ({exc})") from exc
    return results


def load(results_dir: Path, hasher: Hasher = code_hash) -> dict[Key, str]:
    """``(pin, path, guard) -> "e2e" | "FAILED" | "stale"`` from every results file (see the module docstring). A
    proof with a separate control counts as e2e only where a result of today's code shows that control passed on
    the same pin; one that failed makes the proof's cells FAILED."""
    results = read_results(results_dir)
    current = {key: hasher(*key) for key in {(r.pin, r.module) for r in results}}
    fresh = [r for r in results if r.code and r.code == current[(r.pin, r.module)]]
    control_outcomes: dict[tuple[str, str, str], set[str]] = {}
    for r in fresh:
        control_outcomes.setdefault((r.pin, r.module, r.function()), set()).add(r.outcome)
    failed_controls = {(r.pin, r.module) for r in fresh if r.path == CONTROL and r.outcome == "failed"}
    cells: dict[Key, str] = {}
    for r in results:
        for guard in r.guards if r.path != CONTROL else ():
            cells.setdefault((r.pin, r.path, guard), "stale")
    for r in fresh:
        if r.path == CONTROL:
            continue
        control = r.control_id()
        outcomes = control_outcomes.get((r.pin, *control), set()) if control else {"passed"}
        for guard in r.guards:
            key = (r.pin, r.path, guard)
            if r.outcome == "failed" or "failed" in outcomes or (r.pin, r.module) in failed_controls:
                cells[key] = "FAILED"
            elif r.outcome == "passed" and "passed" in outcomes and cells[key] != "FAILED":
                cells[key] = "e2e"
    return cells


def stale_notes(results_dir: Path, hasher: Hasher = code_hash) -> list[str]:
    """Per pin and test module whose results did not run today's code: when they ran, and which code (today's hash
    is left out: these notes change when a result does, not with every commit)."""
    newest: dict[tuple[str, str], Result] = {}
    for r in read_results(results_dir):
        key = (r.pin, r.module)
        if key not in newest or r.date >= newest[key].date:
            newest[key] = r
    notes = []
    for (pin, module), r in sorted(newest.items(), key=lambda item: (release_key(item[0][0]), item[0][1])):
        if r.code != hasher(pin, module):
            ran = f"ran code {r.code}, not today's" if r.code else "no code hash (written before results had one)"
            notes.append(f"{pin} `{module}`: newest result {r.date or 'undated'}, {ran}")
    return notes


def stale_pins(results_dir: Path, pins: Iterable[str], hasher: Hasher = code_hash) -> list[str]:
    """Those of ``pins`` with no result, or with a result that did not run today's code."""
    results = read_results(results_dir) if results_dir.is_dir() else []
    return [pin for pin in pins
            if not any(r.pin == pin for r in results)
            or any(r.code != hasher(pin, r.module) for r in results if r.pin == pin)]


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


def document(cells: dict[Key, str], patches_dir: Path, results_label: str, stale: list[str] | None = None) -> str:
    """docs/matrix.md: what the cells mean, which pins have results, the table, why a cell is stale."""
    run = sorted({pin for pin, _, _ in cells}, key=release_key)
    return "\n".join([
        "# Guard x pin x path matrix (generated)",
        "",
        f"Generated by `sglang-harden doctor --matrix` from the end-to-end results in `{results_label}`, which",
        "`scripts/matrix.sh` writes (CI's two pins, or every supported pin). Each cell is `plugin / patch`: **e2e** a",
        "test proving the guard on that path passed on that pin with today's code (real prefill and decode servers on",
        "CPU), **FAILED** one failed (or a vanilla control of its module did), **stale** results exist but none ran",
        "today's code (hash of the plugin and testbed package, the testbed recipes, the pin's series and the test",
        "module; see below), **static** the path has the guard (the plugin's adapter hooks it, or the pin's series",
        "has a patch for it) but no e2e result is here, **upstream** no patch is needed (SGLang has it itself), **-**",
        "the path does not give it (a release with a patch series only: the plugin refuses to start on it). The",
        "patch path is a patched tree with the plugin uninstalled.",
        "",
        f"Pins with results: {', '.join(run) if run else 'none'}.",
        "",
        render(cells, patches_dir),
        "",
        "Stale results (re-run with `scripts/matrix.sh`, which runs the stale pins):" if stale else "No stale results.",
        "",
        *(f"- {note}" for note in stale or []),
        *([""] if stale else []),
    ])


README_BEGIN, README_END = "<!-- matrix:begin (generated: scripts/matrix.sh) -->", "<!-- matrix:end -->"


def readme_block(cells: dict[Key, str], patches_dir: Path) -> str:
    return f"{README_BEGIN}\n{render(cells, patches_dir)}\n{README_END}"


def write_docs(results_dir: Path, repo: Path) -> None:
    """Rewrite docs/matrix.md and README's matrix block from ``results_dir``."""
    hasher = functools.partial(_hash_in, repo)
    cells = load(results_dir, hasher)
    patches = repo / "patches"
    label = str(results_dir.resolve().relative_to(repo.resolve())) if results_dir.resolve().is_relative_to(
        repo.resolve()) else str(results_dir)
    (repo / "docs" / "matrix.md").write_text(document(cells, patches, label, stale_notes(results_dir, hasher)))
    readme = repo / "README.md"
    text = readme.read_text()
    start, end = text.index(README_BEGIN), text.index(README_END) + len(README_END)
    readme.write_text(text[:start] + readme_block(cells, patches) + text[end:])


def _hash_in(repo: Path, pin: str, module: str) -> str:
    return code_hash(pin, module, repo)
