#!/usr/bin/env python3
"""Weaken each guard in turn and show that a CI test catches it (issue 40's acceptance).

Each entry of :data:`MUTATIONS` names one line of a guard's decision function and its weakened replacement (a
refusal that admits, a comparison that lets a short send through, a MAC check that always matches). Per guard the
script copies the tree (never touching the checkout), applies the one line, runs the CI tests chosen for that guard
the way ``scripts/run_tests.sh`` runs them (the system python; torch tests with a CI pin's venv python, PYTHONPATH
the copy), and records the tests that failed: the mutant is *killed*, or it *survived*. An unmutated copy runs the
same selection first; it must pass, else the baseline is reported broken.

    python3 scripts/mutate_guards.py [--guards a,b] [--python VENV_PY] [--json F] [--markdown F] [--e2e]

Exit status: 0 every mutant killed on a passing baseline; 1 a mutant survived or only crashed, or the baseline
failed; 2 the table does not match the tree (an original line not found exactly once).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = "system"  # python3, as run_tests.sh's whole-suite phase
VENV = "venv"  # a CI pin's venv python (torch), as run_tests.sh's torch phase
COPY_IGNORE = shutil.ignore_patterns(".git", "__pycache__", "*.pyc", ".pytest_cache", ".ruff_cache", ".hypothesis",
                                     ".venvs", "build", "dist", "*.egg-info", "out")
SUMMARY = re.compile(r"^(FAILED|ERROR) (\S+?(?:\[.*?\])?)(?: - .*)?$")


class TableError(RuntimeError):
    """The table does not match the tree: a mutant would silently mutate nothing (or the wrong line)."""


@dataclass(frozen=True)
class Mutation:
    guard: str
    path: str  # relative to the repository root
    original: str  # a unique substring of one line
    replacement: str  # what it becomes (one line)
    weakens: str  # what the weakened guard now lets through
    tests: tuple[str, ...]  # CI test files that should catch it
    runner: str = SYSTEM
    e2e: tuple[str, ...] = ()  # only with --e2e (none needed so far)


G = "sglang_harden/guards/"
MUTATIONS: tuple[Mutation, ...] = (
    Mutation("admission", G + "admission.py",
             "return Decision(GUARD, Verdict.REJECT, view.pending.message, view.pending.status_code, context)",
             "return allow(GUARD, **context)",
             "a request with a pending rejection is admitted at the door",
             ("tests/unit/test_guard_admission.py",)),
    # the length bound moved by one: survived the guard's own tests until test_guard_mutants_admission.py
    Mutation("admission", G + "admission.py",
             "if view.prompt_len > view.limit:",
             "if view.prompt_len > view.limit + 1:",
             "a prompt one token over max_req_input_len is admitted",
             ("tests/unit/test_guard_admission.py", "tests/unit/test_guard_mutants_admission.py")),
    Mutation("admission", G + "admission.py",
             "if view.servable is not None and view.prompt_len > view.servable:",
             "if view.servable is not None and view.prompt_len > view.servable + 1:",
             "a prompt one token longer than the pool can ever admit waits for the timeout instead of a 400",
             ("tests/unit/test_capacity_servable.py",)),
    Mutation("retire", G + "retire.py",
             "return Decision(GUARD, Verdict.ABORT, reason, view.pending.status_code, fields)",
             "return allow(GUARD, rid=view.rid)",
             "a rejected request still sends its last KV chunk",
             ("tests/unit/test_guard_retire.py",)),
    Mutation("coverage", G + "coverage.py",
             "if sent_tokens != reserved_tokens:",
             "if sent_tokens > reserved_tokens:",
             "a short send (fewer tokens than decode reserved) commits",
             ("tests/unit/test_guard_coverage.py",)),
    Mutation("abort_notify", G + "abort_notify.py",
             "safe = writer_drained or not transfer_may_be_in_flight",
             "safe = True",
             "decode releases an aborted room's pages while a write may still land",
             ("tests/unit/test_guard_abort_notify.py",)),
    Mutation("lifecycle", G + "lifecycle.py",
             "return evidence.required_acks > 0 and evidence.acks >= evidence.required_acks",
             "return True",
             "a writer counts as drained without its acks: quarantine ends on no evidence",
             ("tests/unit/test_guard_lifecycle.py",)),
    Mutation("checksum", G + "checksum.py",
             "if value in found:",
             "if value in found or bool(found):",
             "a KV head whose digest differs from prefill's counts as verified",
             ("tests/unit/test_checksum.py",), VENV),
    Mutation("canary", G + "canary.py",
             "missing = sorted(set(unwritten_pages))",
             "missing: list[int] = []",
             "reserved pages still holding the stamp (never written) are ignored",
             ("tests/unit/test_canary.py",), VENV),
    Mutation("page_tags", G + "page_tags.py",
             "if state != PageState.WRITTEN:",
             "if False:",
             "a reserved page this request's transfer never wrote passes",
             ("tests/unit/test_guard_page_tags.py",)),
    Mutation("bootstrap_auth", G + "bootstrap_auth.py",
             "return any(hmac.compare_digest(compute(key).encode(), presented.encode()) for key in keyring.accepted)",
             "return True",
             "any control-plane MAC verifies (forged or wrong-secret tokens accepted)",
             ("tests/unit/test_guard_bootstrap_auth.py",)),
    Mutation("zmq_auth", G + "zmq_auth.py",
             "if not any(hmac.compare_digest(",
             "if False and not any(hmac.compare_digest(",
             "any side-channel auth frame's MAC verifies",
             ("tests/unit/test_guard_zmq_auth.py",)),
    Mutation("side_channels", "sglang_harden/compat/backends/wire_rules.py",
             "reason = rule(self, shape, frames, sender) if rule is not None else None",
             "reason = None",
             "the rank port's sender rules admit anything well-formed (registration takeover, foreign abort, ...)",
             ("tests/unit/test_wire_rules.py",)),
    Mutation("capacity", G + "capacity.py",
             "if mode is CapacityMode.OFF or max_req_input_len >= context_len - margin:",
             "if mode is CapacityMode.OFF or max_req_input_len > 0:",
             "a node whose pool cannot hold its advertised context starts anyway",
             ("tests/unit/test_guard_capacity.py",)),
    Mutation("model_shape", G + "model_shape.py",
             "gaps = [(shape, guard, c) for (shape, guard), c in covers.items() if c.refused]",
             "gaps = [(shape, guard, c) for (shape, guard), c in covers.items() if False]",
             "a node whose KV shape an armed guard covers only in part starts with it armed",
             ("tests/unit/test_guard_model_shape.py",)),
    Mutation("model_shape", G + "model_shape.py",
             'return Coverage(Cover.REFUSED, reason or "no test shows it on this shape", evidence)',
             'return Coverage(Cover.IN_PROCESS, reason or "no test shows it on this shape", evidence)',
             "a shape no test covers counts as covered (the table says yes without a result)",
             ("tests/unit/test_guard_model_shape.py",)),
    # the bound moved by one: survived the gate's own tests until test_guard_mutants_capacity.py
    Mutation("capacity", G + "capacity.py",
             "if mode is CapacityMode.OFF or max_req_input_len >= context_len - margin:",
             "if mode is CapacityMode.OFF or max_req_input_len >= context_len - margin - 1:",
             "a pool one token short of the advertised context passes",
             ("tests/unit/test_guard_capacity.py", "tests/unit/test_guard_mutants_capacity.py")),
)


def required_guards() -> list[str]:
    """Every guard of the configuration, plus the capacity gate (a start-up check with its own mode)."""
    sys.path.insert(0, str(ROOT))
    from sglang_harden.config import GUARDS

    return [*GUARDS, "capacity"]


def locate(root: Path, mutation: Mutation) -> tuple[str, int]:
    """The file's text and the 1-based line of the original; TableError unless it occurs exactly once."""
    if "\n" in mutation.original or "\n" in mutation.replacement:
        raise TableError(f"{mutation.guard}: a mutation is one line")
    if mutation.original == mutation.replacement:
        raise TableError(f"{mutation.guard}: the replacement changes nothing")
    path = root / mutation.path
    if not path.is_file():
        raise TableError(f"{mutation.guard}: {mutation.path} does not exist")
    text = path.read_text()
    count = text.count(mutation.original)
    if count != 1:
        raise TableError(f"{mutation.guard}: {mutation.original!r} occurs {count} times in {mutation.path} "
                         "(expected exactly once: update MUTATIONS in scripts/mutate_guards.py)")
    return text, text[: text.index(mutation.original)].count("\n") + 1


def mutated_text(root: Path, mutation: Mutation) -> str:
    """The file with the one line weakened; TableError if the result does not even compile."""
    text, _ = locate(root, mutation)
    new = text.replace(mutation.original, mutation.replacement, 1)
    try:
        compile(new, mutation.path, "exec")
    except SyntaxError as exc:
        raise TableError(f"{mutation.guard}: the mutant does not compile ({exc})") from None
    return new


def check_table(root: Path, mutations: Sequence[Mutation] = MUTATIONS) -> None:
    for mutation in mutations:
        mutated_text(root, mutation)
        missing = [t for t in (*mutation.tests, *mutation.e2e) if not (root / t).is_file()]
        if missing or not mutation.tests:
            raise TableError(f"{mutation.guard}: test files missing: {missing or 'none chosen'}")


def copy_tree(dest: Path) -> Path:
    shutil.copytree(ROOT, dest, ignore=COPY_IGNORE, symlinks=True)
    return dest


@dataclass
class Run:
    rc: int
    failed: list[str]
    seconds: float
    tail: str


def run_pytest(tree: Path, runner: str, tests: Sequence[str], python: str, timeout_s: float, fail_fast: bool) -> Run:
    exe = sys.executable if runner == SYSTEM else python
    cmd = [exe, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *(["-x"] if fail_fast else []), *tests]
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, out = 124, f"timed out after {timeout_s:.0f} s\n{exc.stdout or ''}"
    failed = [m.group(1) + " " + m.group(2) for m in map(SUMMARY.match, out.splitlines()) if m]
    return Run(rc, failed, time.monotonic() - start, "\n".join(out.splitlines()[-15:]))


@dataclass
class Result:
    guard: str
    file: str
    line: int
    original: str
    replacement: str
    weakens: str
    runner: str
    tests: list[str]
    status: str  # killed | survived | crashed (only errors: collection, import) | baseline broken
    killed_by: list[str] = field(default_factory=list)
    seconds: float = 0.0
    baseline_ok: bool = True


def baseline(tests_by_runner: dict[str, list[str]], python: str, timeout_s: float, work: Path) -> dict[str, Run]:
    tree = copy_tree(work / "baseline")
    runs = {runner: run_pytest(tree, runner, tests, python, timeout_s, False) for runner, tests in
            tests_by_runner.items()}
    shutil.rmtree(tree, ignore_errors=True)
    return runs


def mutate_one(mutation: Mutation, python: str, timeout_s: float, fail_fast: bool, e2e: bool, work: Path,
               base: Run, index: int = 0) -> Result:
    _, line = locate(ROOT, mutation)
    tests = [*mutation.tests, *(mutation.e2e if e2e else ())]
    result = Result(mutation.guard, mutation.path, line, mutation.original, mutation.replacement, mutation.weakens,
                    mutation.runner, tests, "survived")
    broken = [f for f in base.failed if f.split(" ", 1)[1].split("::")[0] in tests] or (
        [f"rc {base.rc}: {base.tail}"] if base.rc != 0 and not base.failed else [])
    if broken:
        result.status, result.baseline_ok, result.killed_by = "baseline broken", False, broken
        return result
    tree = copy_tree(work / f"{index}-{mutation.guard}")
    try:
        (tree / mutation.path).write_text(mutated_text(tree, mutation))
        run = run_pytest(tree, mutation.runner, tests, python, timeout_s, fail_fast)
    finally:
        shutil.rmtree(tree, ignore_errors=True)
    result.seconds = round(run.seconds, 1)
    result.killed_by = [f.split(" ", 1)[1] for f in run.failed if f.startswith("FAILED")]
    if result.killed_by:
        result.status = "killed"
    elif run.rc != 0:
        result.status, result.killed_by = "crashed", run.failed or [f"rc {run.rc}: {run.tail}"]
    return result


def short(nodes: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(f"`{n}`" for n in nodes[:limit])
    return shown + (f" (+{len(nodes) - limit} more)" if len(nodes) > limit else "")


def markdown(results: Sequence[Result], meta: dict[str, object]) -> str:
    lines = [f"Generated {meta['date']} by `{meta['command']}` (total {meta['wall_s']} s, mutants one after another).",
             "",
             "| guard | mutation (one line) | weakened: lets through | killed by (tests that failed) | s |",
             "|---|---|---|---|---|"]
    for r in results:
        where = f"`{Path(r.file).name}:{r.line}`: `{r.original}` → `{r.replacement}`"
        verdict = short(r.killed_by) if r.status == "killed" else f"**{r.status.upper()}** {short(r.killed_by)}"
        runner = " (pin venv)" if r.runner == VENV else ""
        lines.append(f"| {r.guard} | {where}{runner} | {r.weakens} | {verdict} | {r.seconds} |")
    return "\n".join(lines) + "\n"


def default_python() -> str:
    sys.path.insert(0, str(ROOT))
    from sglang_harden.testbed.envs import ci_pins, venv_python

    return str(venv_python(ci_pins()[-1]))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--guards", default="", help="comma-separated subset (default: every entry)")
    p.add_argument("--python", default="", help="a CI pin's venv python for the torch tests (default: newest CI pin)")
    p.add_argument("--json", default="", help="write the results as JSON here")
    p.add_argument("--markdown", default="", help="write the Markdown table here")
    p.add_argument("--e2e", action="store_true", help="also run the entries' e2e tests (minutes)")
    p.add_argument("--fail-fast", action="store_true", help="pytest -x: stop at a mutant's first failing test")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per pytest run")
    p.add_argument("--check", action="store_true", help="only check the table against the tree, run nothing")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    wanted = [g for g in args.guards.split(",") if g]
    unknown = sorted(set(wanted) - {m.guard for m in MUTATIONS})
    if unknown:
        print(f"mutate_guards: no mutation for {unknown}", file=sys.stderr)
        return 2
    chosen = [m for m in MUTATIONS if not wanted or m.guard in wanted]
    try:
        check_table(ROOT, chosen)
        absent = sorted(set(required_guards()) - {m.guard for m in MUTATIONS})
        if absent:
            raise TableError(f"guards without a mutation: {absent}")
    except TableError as exc:
        print(f"mutate_guards: {exc}", file=sys.stderr)
        return 2
    if args.check:
        print(f"mutate_guards: {len(chosen)} mutations match the tree")
        return 0
    python = args.python or default_python()
    if any(m.runner == VENV for m in chosen) and not Path(python).is_file():
        print(f"mutate_guards: no venv python at {python} (scripts/setup_envs.sh, or --python)", file=sys.stderr)
        return 2
    command = "python3 scripts/mutate_guards.py " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None else argv))
    start = time.monotonic()
    by_runner: dict[str, list[str]] = {}
    for m in chosen:
        for t in (*m.tests, *(m.e2e if args.e2e else ())):
            if t not in by_runner.setdefault(m.runner, []):
                by_runner[m.runner].append(t)
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="sgh-mutants-") as tmp:
        base = baseline(by_runner, python, args.timeout, Path(tmp))
        for runner, run in base.items():
            failed = f", failed {run.failed or run.tail}" if run.rc else ""
            print(f"baseline ({runner}): rc {run.rc}, {run.seconds:.1f} s{failed}", flush=True)
        for i, m in enumerate(chosen):
            result = mutate_one(m, python, args.timeout, args.fail_fast, args.e2e, Path(tmp), base[m.runner], i)
            print(f"{result.guard:<15} {result.status:<15} {result.seconds:>6.1f} s  {short(result.killed_by, 2)}",
                  flush=True)
            results.append(result)
    meta: dict[str, object] = {"date": dt.date.today().isoformat(), "command": command,
                               "wall_s": round(time.monotonic() - start, 1), "python": python,
                               "baseline": {r: {"rc": b.rc, "failed": b.failed, "seconds": round(b.seconds, 1)}
                                            for r, b in base.items()}}
    table = markdown(results, meta)
    print("\n" + table)
    if args.markdown:
        Path(args.markdown).write_text(table)
    if args.json:
        Path(args.json).write_text(json.dumps({**meta, "results": [asdict(r) for r in results]}, indent=2) + "\n")
    bad = [r.guard for r in results if r.status != "killed"]
    if bad:
        print(f"mutate_guards: not killed: {bad}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
