"""scripts/mutate_guards.py's table stays tied to the code: every mutation's line is still there exactly once, every
guard has one, and a mutant is one compiling line. (The mutants themselves run with the script: docs/mutations.md.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from sglang_harden.config import GUARDS

ROOT = Path(__file__).resolve().parents[2]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mutate_guards", ROOT / "scripts" / "mutate_guards.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


mg = _load()


@pytest.mark.parametrize("mutation", mg.MUTATIONS, ids=lambda m: f"{m.guard}:{m.replacement}")
def test_each_original_line_occurs_exactly_once_and_the_mutant_is_one_compiling_line(mutation: Any) -> None:
    mg.check_table(ROOT, [mutation])  # raises TableError: the line moved or the mutant does not compile
    before = (ROOT / mutation.path).read_text().splitlines()
    after = mg.mutated_text(ROOT, mutation).splitlines()
    assert len(before) == len(after)
    assert sum(a != b for a, b in zip(before, after, strict=True)) == 1


def test_every_guard_and_the_capacity_gate_has_a_mutation() -> None:
    assert set(mg.required_guards()) == {*GUARDS, "capacity"}
    assert {*GUARDS, "capacity"} <= {m.guard for m in mg.MUTATIONS}


def test_the_table_refuses_a_line_that_is_gone_or_ambiguous(tmp_path: Path) -> None:
    mutation = mg.Mutation("g", "m.py", "return x", "return 0", "anything", ("t.py",))
    (tmp_path / "m.py").write_text("def f(x):\n    return y\n")
    with pytest.raises(mg.TableError, match="occurs 0 times"):
        mg.locate(tmp_path, mutation)
    (tmp_path / "m.py").write_text("def f(x):\n    return x\n\n\ndef g(x):\n    return x\n")
    with pytest.raises(mg.TableError, match="occurs 2 times"):
        mg.locate(tmp_path, mutation)
    (tmp_path / "m.py").write_text("def f(x):\n    return x\n")
    assert mg.locate(tmp_path, mutation)[1] == 2
    with pytest.raises(mg.TableError, match="does not compile"):
        mg.mutated_text(tmp_path, mg.Mutation("g", "m.py", "return x", "return (", "anything", ("t.py",)))


def test_failed_tests_are_read_from_pytests_summary() -> None:
    lines = ["FAILED tests/unit/test_a.py::test_b[x y] - AssertionError: boom", "ERROR tests/unit/test_c.py",
             "PASSED tests/unit/test_d.py::test_e", "2 failed in 0.1s"]
    found = [(m.group(1), m.group(2)) for m in map(mg.SUMMARY.match, lines) if m]
    assert found == [("FAILED", "tests/unit/test_a.py::test_b[x y]"), ("ERROR", "tests/unit/test_c.py")]


def test_a_survivor_is_shown_as_such() -> None:
    result = mg.Result("admission", "sglang_harden/guards/admission.py", 3, "a", "b", "x", mg.SYSTEM, ["t.py"],
                       "survived")
    table = mg.markdown([result], {"date": "2026-01-01", "command": "c", "wall_s": 1.0})
    assert "**SURVIVED**" in table and "`admission.py:3`" in table
