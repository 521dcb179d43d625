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


def test_a_failure_anywhere_wins_over_passes(tmp_path: Path) -> None:
    cells = matrix.load(_results(tmp_path, [
        {"test": "a", "pin": "0.5.19", "path": "plugin", "guards": ["admission"], "outcome": "passed"},
        {"test": "b", "pin": "0.5.19", "path": "plugin", "guards": ["admission"], "outcome": "failed"},
        {"test": "c", "pin": "0.5.19", "path": "plugin", "guards": ["admission"], "outcome": "passed"},
        {"test": "d", "pin": "0.5.23", "path": "patch", "guards": ["coverage"], "outcome": "passed"},
    ]))
    assert cells == {("0.5.19", "plugin", "admission"): "FAILED", ("0.5.23", "patch", "coverage"): "e2e"}


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
        matrix.record(tmp_path, "t", "0.5.19", "plugins", ["admission"], "passed")
    with pytest.raises(ValueError, match="not among"):
        matrix.record(tmp_path, "t", "0.5.19", "plugin", ["admision"], "passed")


def test_the_suite_records_marked_tests_per_pin(tmp_path: Path) -> None:
    """The collector in tests/conftest.py, on a small suite: passes and failures are recorded, skips are not."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text((REPO / "tests" / "conftest.py").read_text())
    (suite / "test_marked.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.proves("plugin", "admission")
        @pytest.mark.parametrize("pin", ["0.5.19"])
        def test_passes(pin):
            pass

        @pytest.mark.proves("patch", "coverage")
        @pytest.mark.parametrize("pin", ["0.5.23"])
        def test_fails(pin):
            assert False

        @pytest.mark.proves("plugin", "retire")
        @pytest.mark.parametrize("pin", ["0.5.19"])
        def test_skips(pin):
            pytest.skip("not selected")

        @pytest.mark.proves("plugin", "canary")
        @pytest.mark.parametrize("case", ["0.5.23/nixl/paged16"])
        def test_case_named(case):
            pass

        @pytest.mark.proves("plugin", "page_tags")
        @pytest.mark.parametrize("pin", ["0.5.19/mooncake"])
        def test_pin_named_like_a_case(pin):
            pass

        @pytest.mark.proves("plugin", "no_such_guard")
        @pytest.mark.parametrize("pin", ["0.5.19"])
        def test_badly_marked(pin):
            pass
    """))
    results = tmp_path / "results"
    env = {**os.environ, matrix.ENV: str(results), "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          str(suite)], env=env, cwd=tmp_path, capture_output=True, text=True, check=False, timeout=120)
    assert "1 failed, 4 passed, 1 skipped" in run.stdout, "a bad mark warns, it does not end the session"
    assert "matrix result of" in run.stdout and "no_such_guard" in run.stdout
    assert matrix.load(results) == {("0.5.19", "plugin", "admission"): "e2e", ("0.5.23", "patch", "coverage"): "FAILED",
                                    ("0.5.23", "plugin", "canary"): "e2e", ("0.5.19", "plugin", "page_tags"): "e2e"}


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
    expected = matrix.document(matrix.load(results), REPO / "patches", "docs/e2e-results")
    assert (REPO / "docs" / "matrix.md").read_text() == expected
