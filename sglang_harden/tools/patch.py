"""``sglang-harden patch list|apply|verify``: the backport patch series for operators who build their own images.

A series lives in ``patches/<pin>/series`` (one ``NNNN-name.patch`` per line, ``#`` comments) next to its
unified diffs, ``-p1`` relative to the directory that contains ``sglang/`` (a site-packages, an unpacked
wheel). The patched tree does not import sglang-harden.

- ``apply`` refuses a tree whose ``sglang`` version is not the pin, then applies the whole series to a staging
  copy of the touched files (GNU ``patch``, no fuzz); only if every patch applies are the files put in place,
  so a reject never leaves a half-applied tree. A tree that already carries the whole series is left alone.
- ``verify`` says, per patch, whether the tree carries it: it un-applies the series, last patch first, on a
  staging copy (a patch counts as present when its reverse applies exactly).
- ``list`` shows the pins that have a series, or one pin's series with each patch's one-line summary.

Exit codes: 0 ok; 1 verify: some patch missing; 2 usage (unknown pin, no tree, no ``patch`` tool);
3 version mismatch; 4 a patch does not apply (reject) or the tree is partly patched.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sglang_harden.compat.pins import PATCHED_TREE_MARKER, RELEASE_RE, release_key
from sglang_harden.compat.reach import next_step

EXIT_OK, EXIT_MISSING, EXIT_USAGE, EXIT_VERSION, EXIT_REJECT = 0, 1, 2, 3, 4
PATCHES_ENV = "SGLANG_HARDEN_PATCHES"
_VERSION_RE = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M)
_TARGET_RE = re.compile(r"^\+\+\+ b/(\S+)", re.M)
_SUBJECT_PREFIX_RE = re.compile(r"^\[PATCH[^\]]*\]\s*")
# The module every series adds, which carries the release of sglang-harden that generated the series.
SERIES_STAMP_FILE = "/".join(("sglang", *PATCHED_TREE_MARKER))
_STAMP_RE = re.compile(r"""^\+?SERIES_VERSION = ['"]([^'"]+)['"]""", re.M)


class PatchError(Exception):
    """A refusal with an exit code and a message for the operator."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Patch:
    name: str
    path: Path
    summary: str
    targets: tuple[str, ...]


@dataclass
class Report:
    action: str
    pin: str | None
    tree: str | None = None
    tree_version: str | None = None
    series_version: str | None = None  # the sglang-harden release that generated the series used
    tree_series_version: str | None = None  # ... the one the tree carries
    ok: bool = True
    message: str = ""
    patches: list[dict[str, object]] = field(default_factory=list)


# ---------------------------------------------------------------- locating series


def default_patches_dir() -> Path:
    """``$SGLANG_HARDEN_PATCHES``, else ``patches/`` of this checkout, else the copy shipped in the wheel."""
    override = os.environ.get(PATCHES_ENV)
    if override:
        return Path(override)
    checkout = Path(__file__).resolve().parents[2] / "patches"
    if checkout.is_dir():
        return checkout
    return Path(__file__).resolve().parents[1] / "_patches"


def available_pins(patches_dir: Path) -> list[str]:
    if not patches_dir.is_dir():
        return []
    return sorted((p.name for p in patches_dir.iterdir() if (p / "series").is_file()), key=_release_order)


def _release_order(name: str) -> tuple[bool, tuple[int, int, int, int], str]:
    """Releases oldest first, then any other folder name."""
    release = RELEASE_RE.match(name) is not None
    return not release, release_key(name) if release else (0, 0, 0, 0), name


def load_series(pin: str, patches_dir: Path) -> list[Patch]:
    folder = patches_dir / pin
    series_file = folder / "series"
    if not series_file.is_file():
        known = available_pins(patches_dir)
        raise PatchError(f"no patch series for SGLang {pin} in {patches_dir} (series exist for: "
                         f"{', '.join(known) or 'none'}). {next_step(pin, known)}".rstrip(), EXIT_USAGE)
    patches = []
    for line in series_file.read_text().splitlines():
        name = line.split("#", 1)[0].strip()
        if not name:
            continue
        path = folder / name
        if not path.is_file():
            raise PatchError(f"{series_file} lists {name}, which does not exist", EXIT_USAGE)
        text = path.read_text()
        patches.append(Patch(name, path, _summary(text), tuple(dict.fromkeys(_TARGET_RE.findall(text)))))
    return patches


def _summary(text: str) -> str:
    """The patch's subject (``Subject: [PATCH i/N] ...`` of a mail-formatted patch), else its first line."""
    for line in text.splitlines():
        if line.startswith("Subject:"):
            return _SUBJECT_PREFIX_RE.sub("", line[len("Subject:"):].strip())
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


# ---------------------------------------------------------------- reading a tree


def tree_version(tree: Path) -> str | None:
    """The SGLang version a tree declares (``sglang/_version.py`` or ``sglang/version.py``), without importing."""
    for name in ("_version.py", "version.py"):
        path = tree / "sglang" / name
        if path.is_file():
            found = _VERSION_RE.search(path.read_text(errors="replace"))
            if found:
                return found.group(1)
    return None


def _require_tree(tree: Path) -> None:
    if not (tree / "sglang").is_dir():
        raise PatchError(f"{tree} does not contain an sglang/ package (give the directory that holds sglang/, "
                         "e.g. a site-packages or an unpacked wheel)", EXIT_USAGE)


def _require_patch_tool() -> str:
    tool = shutil.which("patch")
    if tool is None:
        raise PatchError("GNU patch is not installed (apt-get install patch)", EXIT_USAGE)
    return tool


# ---------------------------------------------------------------- staging


def _stage(tree: Path, patches: Iterable[Patch], dest: Path) -> list[str]:
    """Copy the files the series touches (those that exist) into ``dest``; return the touched paths."""
    touched = list(dict.fromkeys(t for p in patches for t in p.targets))
    for rel in touched:
        src = tree / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return touched


def _run_patch(staging: Path, patch: Patch, reverse: bool = False, dry_run: bool = False) -> tuple[bool, str]:
    cmd = [_require_patch_tool(), "-p1", "--batch", "--fuzz=0", "--no-backup-if-mismatch", "-r", "-",
           "-d", str(staging), "-i", str(patch.path)]
    # --force with --reverse: never let patch "helpfully" apply forward a patch that looks unapplied.
    cmd += ["--reverse", "--force"] if reverse else ["--forward"]
    if dry_run:
        cmd.append("--dry-run")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return proc.returncode == 0, (proc.stdout + proc.stderr).strip()


def _install(staging: Path, tree: Path, touched: list[str]) -> None:
    """Put staged files in place: each written next to its target, then renamed over it."""
    for rel in touched:
        src, dst = staging / rel, tree / rel
        if not src.is_file():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(dst.name + ".sglang-harden-tmp")
        shutil.copy2(src, tmp)
        os.replace(tmp, dst)
        _drop_bytecode(dst)


def _drop_bytecode(path: Path) -> None:
    cache = path.parent / "__pycache__"
    if cache.is_dir():
        for pyc in cache.glob(path.stem + ".*.pyc"):
            pyc.unlink(missing_ok=True)


# ---------------------------------------------------------------- verify / apply


def verify_tree(tree: Path, patches: list[Patch]) -> list[dict[str, object]]:
    """Per patch: ``applied`` True/False, judged by un-applying the series last-first on a staging copy."""
    results: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory(prefix="sglang-harden-verify-") as tmp:
        staging = Path(tmp)
        _stage(tree, patches, staging)
        for patch in reversed(patches):
            applied, output = _run_patch(staging, patch, reverse=True, dry_run=True)
            if applied:
                _run_patch(staging, patch, reverse=True)
            results[patch.name] = {"patch": patch.name, "summary": patch.summary, "applied": applied,
                                   "detail": "" if applied else _last_lines(output)}
    return [results[p.name] for p in patches]


def _last_lines(text: str, n: int = 4) -> str:
    return "\n".join(text.splitlines()[-n:])


def check_version(tree: Path, pin: str) -> str | None:
    found = tree_version(tree)
    if found != pin:
        raise PatchError(f"version mismatch: {tree}/sglang is SGLang {found or 'of unknown version'}, "
                         f"the series is for {pin}; pick --pin {found} if a series exists for it", EXIT_VERSION)
    return found


def apply_series(tree: Path, pin: str, patches_dir: Path | None = None) -> Report:
    """Apply ``pin``'s series to ``tree`` all-or-nothing; raise PatchError on a refusal."""
    tree = Path(tree)
    _require_tree(tree)
    patches = load_series(pin, patches_dir or default_patches_dir())
    report = Report("apply", pin, str(tree), check_version(tree, pin), series_stamp(patches))
    state = verify_tree(tree, patches)
    if all(s["applied"] for s in state):
        report.message = f"already applied: all {len(patches)} patches of {pin} are in {tree}"
        report.patches = [{**s, "result": "already applied"} for s in state]
        return report
    carried = tree_series_stamp(tree)
    if carried not in (None, report.series_version):
        raise PatchError(f"{tree} carries the series of sglang-harden {carried}, this series is sglang-harden "
                         f"{report.series_version}'s: start from a clean {pin} tree", EXIT_REJECT)
    if any(s["applied"] for s in state):
        have = ", ".join(str(s["patch"]) for s in state if s["applied"])
        raise PatchError(f"{tree} is partly patched ({have}); start from a clean {pin} tree", EXIT_REJECT)
    with tempfile.TemporaryDirectory(prefix="sglang-harden-apply-") as tmp:
        staging = Path(tmp)
        touched = _stage(tree, patches, staging)
        for patch in patches:
            ok, output = _run_patch(staging, patch)
            if not ok:
                raise PatchError(f"{patch.name} does not apply to {tree} (nothing was changed):\n"
                                 f"{_last_lines(output, 8)}", EXIT_REJECT)
            report.patches.append({"patch": patch.name, "summary": patch.summary, "result": "applied"})
        _install(staging, tree, touched)
    report.message = (f"applied {len(patches)} patches of {pin} to {tree}. The series holds the guards: where the "
                      "sglang-harden plugin is installed beside this tree it stays off (pip uninstall sglang-harden)")
    return report


def series_stamp(patches: Iterable[Patch]) -> str | None:
    """The sglang-harden release that generated a series (its stamp in the module every series adds)."""
    for patch in patches:
        if SERIES_STAMP_FILE in patch.targets:
            found = _STAMP_RE.search(patch.path.read_text())
            return found.group(1) if found else None
    return None


def tree_series_stamp(tree: Path) -> str | None:
    """The stamp a patched tree carries (None: no series, or one generated before series were stamped)."""
    path = Path(tree) / SERIES_STAMP_FILE
    found = _STAMP_RE.search(path.read_text()) if path.is_file() else None
    return found.group(1) if found else None


def verify_series(tree: Path, pin: str | None = None, patches_dir: Path | None = None) -> Report:
    tree = Path(tree)
    _require_tree(tree)
    found = tree_version(tree)
    pin = pin or found
    if pin is None:
        raise PatchError(f"cannot read the SGLang version of {tree}; pass --pin", EXIT_USAGE)
    patches = load_series(pin, patches_dir or default_patches_dir())
    report = Report("verify", pin, str(tree), found, series_stamp(patches), tree_series_stamp(tree))
    report.patches = verify_tree(tree, patches)
    missing = [str(p["patch"]) for p in report.patches if not p["applied"]]
    other_series = report.tree_series_version not in (None, report.series_version)
    report.ok = not missing and found == pin and not other_series
    if found != pin:
        report.message = f"tree is SGLang {found}, series is for {pin}"
    elif other_series:
        report.message = (f"the tree carries the series of sglang-harden {report.tree_series_version}, this series "
                          f"is sglang-harden {report.series_version}'s: apply it to an unpatched copy of SGLang {pin}")
    elif missing:
        report.message = f"{len(missing)} of {len(patches)} patches missing: {', '.join(missing)}"
    else:
        report.message = (f"all {len(patches)} patches of {pin} present (the series of sglang-harden "
                          f"{report.series_version})")
    return report


# ---------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("list", "apply", "verify"))
    parser.add_argument("--pin", help="SGLang version of the series (default for verify: the tree's version)")
    parser.add_argument("--tree", type=Path, help="directory that contains sglang/ (site-packages, unpacked wheel)")
    parser.add_argument("--patches", type=Path, default=None,
                        help=f"patch folder (default: ${PATCHES_ENV} or this checkout's patches/)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _list(args: argparse.Namespace, patches_dir: Path) -> Report:
    if not args.pin:
        pins = available_pins(patches_dir)
        report = Report("list", None, message=f"series in {patches_dir}: {', '.join(pins) or 'none'}")
        report.patches = [{"pin": pin, "count": len(load_series(pin, patches_dir))} for pin in pins]
        return report
    series = load_series(args.pin, patches_dir)
    report = Report("list", args.pin, message=f"{len(series)} patches for SGLang {args.pin}")
    report.patches = [{"patch": p.name, "summary": p.summary, "files": list(p.targets)} for p in series]
    return report


def _render(report: Report) -> str:
    lines = [report.message]
    for entry in report.patches:
        if "pin" in entry:
            lines.append(f"  {entry['pin']:<14} {entry['count']} patches")
            continue
        state = entry.get("result") or ("present" if entry.get("applied") else
                                        "MISSING" if "applied" in entry else "")
        lines.append(f"  {entry['patch']:<48} {state:<16} {entry.get('summary', '')}".rstrip())
    return "\n".join(lines)


def _emit(report: Report, as_json: bool) -> None:
    try:
        print(json.dumps(asdict(report), indent=2) if as_json else _render(report))
    except BrokenPipeError:  # e.g. piped into head: the exit code still tells the result
        sys.stderr.close()


def run(args: argparse.Namespace) -> int:
    patches_dir = args.patches or default_patches_dir()
    try:
        if args.action == "list":
            report = _list(args, patches_dir)
        elif args.tree is None:
            raise PatchError(f"patch {args.action} needs --tree DIR (the directory that contains sglang/)",
                             EXIT_USAGE)
        elif args.action == "apply":
            pin = args.pin or tree_version(args.tree)
            if pin is None:
                raise PatchError(f"cannot read the SGLang version of {args.tree}; pass --pin", EXIT_USAGE)
            report = apply_series(args.tree, pin, patches_dir)
        else:
            report = verify_series(args.tree, args.pin, patches_dir)
    except PatchError as exc:
        failed = Report(args.action, args.pin, str(args.tree) if args.tree else None, ok=False, message=str(exc))
        if args.json:
            print(json.dumps({**asdict(failed), "exit_code": exc.code}, indent=2))
        else:
            print(f"sglang-harden patch {args.action}: {exc}", file=sys.stderr)
        return exc.code
    _emit(report, args.json)
    return EXIT_OK if report.ok else EXIT_MISSING
