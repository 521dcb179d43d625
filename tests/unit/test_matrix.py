"""The guard x pin x path matrix (``sglang-harden doctor --matrix``): built from e2e results, never written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sglang_harden.tools import matrix
from sglang_harden.tools.patch import default_patches_dir

REPO = Path(__file__).resolve().parents[2]


def _results(tmp_path: Path, lines: list[dict[str, object]]) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "x.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return tmp_path


def _same_code(pin: str, module: str) -> str:
    return "h-" + pin


def test_a_failure_anywhere_wins_over_passes(tmp_path: Path) -> None:
    cells = matrix.load(_results(tmp_path, [
        {"test": t, "pin": pin, "path": path, "guards": [guard], "outcome": outcome, "code": "h-" + pin}
        for t, pin, path, guard, outcome in [("a", "0.5.19", "plugin", "admission", "passed"),
                                             ("b", "0.5.19", "plugin", "admission", "failed"),
                                             ("c", "0.5.19", "plugin", "admission", "passed"),
                                             ("d", "0.5.23", "patch", "coverage", "passed")]
    ]), _same_code)
    assert cells == {("0.5.19", "plugin", "admission"): "FAILED", ("0.5.23", "patch", "coverage"): "e2e"}


def test_a_result_of_other_code_is_stale_and_says_why(tmp_path: Path) -> None:
    """A cell is e2e only with a result of today's code; an old failure does not outlive a fix, an old pass does
    not vouch for new code, a result without a hash (written before results carried one) vouches for nothing."""
    results = _results(tmp_path, [
        {"test": "m.py::a", "pin": "0.5.19", "path": "plugin", "guards": ["admission"], "outcome": "passed",
         "code": "old", "date": "2026-11-01"},
        {"test": "m.py::b", "pin": "0.5.19", "path": "plugin", "guards": ["retire"], "outcome": "failed",
         "code": "old", "date": "2026-11-01"},
        {"test": "m.py::b", "pin": "0.5.19", "path": "plugin", "guards": ["retire"], "outcome": "passed",
         "code": "h-0.5.19", "date": "2026-12-06"},
        {"test": "n.py::c", "pin": "0.5.23", "path": "patch", "guards": ["coverage"], "outcome": "passed"},
    ])
    assert matrix.load(results, _same_code) == {("0.5.19", "plugin", "admission"): "stale",
                                                ("0.5.19", "plugin", "retire"): "e2e",
                                                ("0.5.23", "patch", "coverage"): "stale"}
    notes = matrix.stale_notes(results, _same_code)
    assert notes == ["0.5.23 `n.py`: newest result undated, no code hash (written before results had one)"], \
        "0.5.19's newest results of m.py ran today's code"
    assert matrix.stale_pins(results, ["0.5.19", "0.5.22", "0.5.23"], _same_code) == ["0.5.19", "0.5.22", "0.5.23"], \
        "0.5.19 still has an old result line, 0.5.22 has none, 0.5.23's is stale"


def test_a_failed_control_fails_the_cells_its_module_proves(tmp_path: Path) -> None:
    """A vanilla control that failed (the fault did not fire) leaves its module's proofs vacuous: FAILED."""
    results = _results(tmp_path, [
        {"test": "m.py::proof", "pin": "0.5.19", "path": "plugin", "guards": ["lifecycle"], "outcome": "passed",
         "code": "h-0.5.19"},
        {"test": "m.py::vanilla_control", "pin": "0.5.19", "path": "control", "guards": [], "outcome": "failed",
         "code": "h-0.5.19"},
        {"test": "n.py::proof", "pin": "0.5.19", "path": "plugin", "guards": ["canary"], "outcome": "passed",
         "code": "h-0.5.19"},
    ])
    assert matrix.load(results, _same_code) == {("0.5.19", "plugin", "lifecycle"): "FAILED",
                                                ("0.5.19", "plugin", "canary"): "e2e"}


def test_the_code_hash_follows_the_code_a_result_ran(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    for rel, text in {"sglang_harden/guards/x.py": "a = 1\n", "ci/pins.toml": "[ci]\n", "tests/conftest.py": "",
                      "tests/e2e/test_m.py": "def test(): pass\n", "patches/0.5.19/0001-x.patch": "p\n",
                      "patches/0.5.23/0001-x.patch": "q\n", "docs/matrix.md": "m\n"}.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)

    def now(pin: str = "0.5.19") -> str:
        matrix._package_hash.cache_clear()
        return matrix.code_hash(pin, "tests/e2e/test_m.py", repo)

    before = now()
    (repo / "docs" / "matrix.md").write_text("regenerated\n")
    (repo / "patches" / "0.5.23" / "0001-x.patch").write_text("other pin\n")
    assert now() == before, "docs and another pin's series do not change a result"
    for rel in ("sglang_harden/guards/x.py", "ci/pins.toml", "tests/e2e/test_m.py", "patches/0.5.19/0001-x.patch"):
        (repo / rel).write_text((repo / rel).read_text() + "# changed\n")
        assert now() != before, f"{rel} changes what a result proves"
        before = now()


def test_cells_say_e2e_static_or_absent(tmp_path: Path) -> None:
    cells = {("0.5.23", "plugin", "lifecycle"): "e2e", ("0.5.23", "patch", "coverage"): "e2e"}
    rows = {line.split(" | ")[0].strip("| "): line for line in matrix.render(cells, default_patches_dir()).splitlines()}
    cols = ["pin", *matrix.COLUMNS]
    row = dict(zip(cols, [c.strip() for c in rows["0.5.23"].strip("|").split("|")], strict=True))
    assert row["lifecycle"] == "e2e / static", "the plugin proved it; the 0.5.23 series patches it, not run here"
    assert row["checksum"] == "static / static", "hooked by the plugin and patched by the series, neither run here"
    old_row = dict(zip(cols, [c.strip() for c in rows["0.5.18"].strip("|").split("|")], strict=True))
    assert old_row["checksum"] == "- / static" and old_row["lifecycle"] == "- / static", "0.5.18: patch path only"
    old_row = dict(zip(cols, [c.strip() for c in rows["0.5.10.post1"].strip("|").split("|")], strict=True))
    assert old_row["lifecycle"] == "- / static", "0.5.10.post1's lifecycle patch brings its own notice and acks"
    assert row["coverage"] == "static / e2e"
    assert row["bootstrap_auth"] == "static / static"
    assert row["admission"] == "static / upstream" and row["retire"] == "static / upstream"
    old = dict(zip(cols, [c.strip() for c in rows["0.4.9.post6"].strip("|").split("|")], strict=True))
    assert old["admission"] == "static / static"
    assert old["page_tags"] == old["canary"] == old["checksum"] == old["lifecycle"] == old["bootstrap_auth"] == \
        "- / static", "the 0.4.x series patch them; the plugin has no hook for them on 0.4.x"


def test_bad_results_are_refused_naming_the_line(tmp_path: Path) -> None:
    (tmp_path / "0.5.19.jsonl").write_text('{"pin": "0.5.19"}\n')
    with pytest.raises(ValueError, match="0.5.19.jsonl:1"):
        matrix.load(tmp_path)
    with pytest.raises(ValueError, match="one of"):
        matrix.record(tmp_path, "t", "0.5.19", "plugins", ["admission"], "passed", "h")
    with pytest.raises(ValueError, match="not among"):
        matrix.record(tmp_path, "t", "0.5.19", "plugin", ["admision"], "passed", "h")
    with pytest.raises(ValueError, match="names no guards"):
        matrix.record(tmp_path, "t", "0.5.19", "control", ["admission"], "passed", "h")


def test_the_suite_records_marked_tests_per_pin(tmp_path: Path) -> None:
    """The collector in tests/conftest.py, on a small suite: passes and failures are recorded, skips are not."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (suite / "test_marked.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.proves("plugin", "admission", control="self")
        @pytest.mark.parametrize("pin", ["0.5.19"])
        def test_passes(pin):
            pass

        @pytest.mark.proves("patch", "coverage", control="self")
        @pytest.mark.parametrize("pin", ["0.5.23"])
        def test_fails(pin):
            assert False

        @pytest.mark.proves("plugin", "retire", control="self")
        @pytest.mark.parametrize("pin", ["0.5.19"])
        def test_skips(pin):
            pytest.skip("not selected")

        @pytest.mark.proves("plugin", "canary", control="self")
        @pytest.mark.parametrize("case", ["0.5.23/nixl/paged16"])
        def test_case_named(case):
            pass

        @pytest.mark.proves("plugin", "page_tags", control="test_vanilla_control")
        @pytest.mark.parametrize("pin", ["0.5.19/mooncake"])
        def test_pin_named_like_a_case(pin):
            pass

        @pytest.mark.proves("plugin", "no_such_guard", control="self")
        @pytest.mark.parametrize("pin", ["0.5.19"])
        def test_badly_marked(pin):
            pass

        @pytest.mark.parametrize("pin", ["0.5.19"])
        def test_vanilla_control(pin):
            assert False, "the fault did not fire"
    """))
    (suite / "test_unmarked.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.parametrize("pin", ["0.5.19"])
        def test_not_a_proof(pin):
            pass
    """))
    results = tmp_path / "results"
    env = {**os.environ, matrix.ENV: str(results), "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          str(suite)], env=env, cwd=tmp_path, capture_output=True, text=True, check=False, timeout=120)
    assert "2 failed, 5 passed, 1 skipped" in run.stdout, run.stdout + run.stderr
    assert "matrix result of" in run.stdout and "no_such_guard" in run.stdout
    lines = matrix.read_results(results)
    assert {r.test.split("::")[1] for r in lines} == {
        "test_passes[0.5.19]", "test_fails[0.5.23]", "test_case_named[0.5.23/nixl/paged16]",
        "test_pin_named_like_a_case[0.5.19/mooncake]", "test_vanilla_control[0.5.19]"}, \
        "every test of a proving module (a bad mark and a skip excepted), none of another module"
    assert {r.module for r in lines} == {"suite/test_marked.py"}, "pytest's root: the run's directory"
    assert {r.code for r in lines} == {matrix.code_hash("0.5.19", "suite/test_marked.py", tmp_path),
                                       matrix.code_hash("0.5.23", "suite/test_marked.py", tmp_path)}
    assert next(r for r in lines if "vanilla_control" in r.test).path == matrix.CONTROL
    assert matrix.load(results, lambda pin, module: matrix.code_hash(pin, module, tmp_path)) == {
        ("0.5.19", "plugin", "admission"): "FAILED", ("0.5.23", "patch", "coverage"): "FAILED",
        ("0.5.23", "plugin", "canary"): "e2e", ("0.5.19", "plugin", "page_tags"): "FAILED"}, \
        "0.5.19's failed control fails the 0.5.19 cells its module proves"
    assert next(r for r in lines if "pin_named_like" in r.test).control == "test_vanilla_control"
    assert set(matrix.load(results).values()) == {"stale"}, "the repository's code is not the suite's"


@pytest.mark.parametrize(("mark", "problem"), [
    ('proves("plugin", "admission")', "has no control="),
    ('proves("plugin", "admission", control="test_nowhere")', "is not a test of"),
    ('proves("plugin", "admission", control="test_other_proof")', "is itself a proves test"),
])
def test_a_proof_without_a_control_fails_collection(tmp_path: Path, mark: str, problem: str) -> None:
    (tmp_path / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (tmp_path / "test_proofs.py").write_text(textwrap.dedent(f"""
        import pytest

        @pytest.mark.{mark}
        def test_proof():
            pass

        @pytest.mark.proves("plugin", "retire", control="self")
        def test_other_proof():
            pass
    """))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          str(tmp_path)], env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=tmp_path,
                         capture_output=True, text=True, check=False, timeout=120)
    assert run.returncode == pytest.ExitCode.USAGE_ERROR, run.stdout + run.stderr
    assert "a proves test without a negative control" in run.stderr and problem in run.stderr, run.stderr


def test_a_proof_counts_only_with_its_control_passed_on_the_same_pin(tmp_path: Path) -> None:
    def line(test: str, pin: str, outcome: str, control: str = "", guards: tuple[str, ...] = ("lifecycle",),
             path: str = "patch") -> dict[str, object]:
        return {"test": test, "pin": pin, "path": path if guards else "control", "guards": list(guards),
                "outcome": outcome, "code": "h-" + pin, "control": control}

    control = "tests/e2e/v.py::test_vanilla_corrupts"
    results = _results(tmp_path, [
        line("tests/e2e/p.py::test_proof[0.5.19/mooncake]", "0.5.19", "passed", control),
        line("tests/e2e/v.py::test_vanilla_corrupts[0.5.19/mooncake]@v:0.5.19", "0.5.19", "passed", guards=()),
        line("tests/e2e/p.py::test_proof[0.5.18/mooncake]", "0.5.18", "passed", control),
        line("tests/e2e/p.py::test_proof[0.5.23/mooncake]", "0.5.23", "passed", control),
        line("tests/e2e/v.py::test_vanilla_corrupts[0.5.23/mooncake]", "0.5.23", "failed", guards=()),
    ])
    assert matrix.load(results, _same_code) == {
        ("0.5.19", "patch", "lifecycle"): "e2e",
        ("0.5.18", "patch", "lifecycle"): "stale",  # no control result on 0.5.18: the proof vouches for nothing
        ("0.5.23", "patch", "lifecycle"): "FAILED"}


def test_every_proves_mark_in_the_suite_names_a_path_and_known_guards() -> None:
    import ast

    found = 0
    for path in (REPO / "tests" / "e2e").glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "pytest.mark.proves":
                args = [ast.literal_eval(arg) for arg in node.args]
                assert args[0] in matrix.PATHS and set(args[1:]) <= set(matrix.COLUMNS) and args[1:], (path, args)
                found += 1
    assert found >= 30


def test_readmes_matrix_is_generated_from_the_committed_results() -> None:
    cells = matrix.load(REPO / "docs" / "e2e-results")
    assert matrix.readme_block(cells, REPO / "patches") in (REPO / "README.md").read_text()


def test_the_committed_matrix_is_generated_from_the_committed_results() -> None:
    """docs/matrix.md is what `sglang-harden doctor --matrix` prints for docs/e2e-results (scripts/matrix.sh
    rewrites both)."""
    results = REPO / "docs" / "e2e-results"
    expected = matrix.document(matrix.load(results), REPO / "patches", "docs/e2e-results", matrix.stale_notes(results))
    assert (REPO / "docs" / "matrix.md").read_text() == expected


def test_no_committed_cell_says_e2e_without_a_result_of_todays_code() -> None:
    """Change the code a cell's result ran and the cell must say stale until the test runs again."""
    committed = (REPO / "docs" / "matrix.md").read_text()
    fresh = {(r.pin, r.path, guard) for r in matrix.read_results(REPO / "docs" / "e2e-results")
             if r.outcome == "passed" and r.code == matrix.code_hash(r.pin, r.module) for guard in r.guards}
    for line in committed.splitlines():
        if not line.startswith("| ") or line.startswith("| pin"):
            continue
        pin, *cells = [c.strip() for c in line.strip("|").split("|")]
        for guard, cell in zip(matrix.COLUMNS, cells, strict=True):
            for path, value in zip(matrix.PATHS, cell.split(" / "), strict=True):
                if value == "e2e":
                    assert (pin, path, guard) in fresh, f"{pin} {path} {guard}: e2e without a result of today's code"
