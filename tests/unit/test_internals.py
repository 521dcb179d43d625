"""SGLang's internal names are spelled once, in ``compat/internals.py``: no other module of the package spells an
SGLang module path, no ``Class.method`` of SGLang is spelled both in ``compat/`` (the hook tables) and in
``tools/`` (doctor's detectors), and the backport series patch the files those names point at. A rename upstream
is then one edit, and the hook, the detector and the patch cannot drift apart. (Test-only shims under
``testbed/shims`` run inside SGLang on their own and are not part of this.)"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from sglang_harden.compat import internals

PACKAGE = Path(__file__).resolve().parents[2] / "sglang_harden"
PATCH_SOURCE = PACKAGE.parent / "patches" / "_source"
MODULE_PATH = re.compile(r"^sglang\.(srt|kernels)(\.|$)")
QUALNAME = re.compile(r"^[A-Z][A-Za-z0-9]+\.[_a-z]\w*$")


def _package_files() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if "shims" not in p.parts and p.name != "internals.py"]


def _strings(path: Path) -> list[tuple[int, str]]:
    """String constants of ``path``, with the literal parts of f-strings; docstrings and comments excluded."""
    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]


def module_paths_outside_internals(files: list[Path]) -> list[str]:
    return [f"{path.name}:{line}: {text!r}" for path in files for line, text in _strings(path)
            if MODULE_PATH.match(text)]


def qualnames_in_both(compat: list[Path], tools: list[Path]) -> set[str]:
    def names(files: list[Path]) -> set[str]:
        return {text for path in files for _, text in _strings(path) if QUALNAME.match(text)}

    return names(compat) & names(tools)


def test_no_module_path_is_spelled_outside_internals() -> None:
    assert module_paths_outside_internals(_package_files()) == []


def test_no_sglang_function_is_named_by_both_the_hooks_and_the_detectors() -> None:
    files = _package_files()
    compat = [p for p in files if "compat" in p.relative_to(PACKAGE).parts]
    tools = [p for p in files if "tools" in p.relative_to(PACKAGE).parts]
    assert compat and tools
    assert qualnames_in_both(compat, tools) == set()


def test_the_checks_catch_a_second_spelling(tmp_path: Path) -> None:
    (tmp_path / "hooks.py").write_text('TARGET = "DecodeTransferQueue.pop_transferred"\n')
    (tmp_path / "detector.py").write_text('"""Mentions sglang.srt.x in prose."""\nREF = ("sglang.srt.disaggregation'
                                          '.decode", "DecodeTransferQueue.pop_transferred")\n')
    assert qualnames_in_both([tmp_path / "hooks.py"], [tmp_path / "detector.py"]) == {
        "DecodeTransferQueue.pop_transferred"}
    found = module_paths_outside_internals([tmp_path / "detector.py"])
    assert len(found) == 1 and "sglang.srt.disaggregation.decode" in found[0]


def test_the_backport_series_patch_the_files_the_plugin_hooks() -> None:
    sys.path.insert(0, str(PATCH_SOURCE))
    try:
        import common_text
    finally:
        sys.path.remove(str(PATCH_SOURCE))
    assert common_text.PREFILL == internals.source_file(internals.PREFILL) == "sglang/srt/disaggregation/prefill.py"
    assert common_text.DECODE == "sglang/srt/disaggregation/decode.py"
    assert common_text.CONN == internals.source_file(internals.CONN)
    assert common_text.TOKENIZER == internals.source_file(internals.TOKENIZER)
    assert common_text.MOONCAKE == internals.source_file(internals.MOONCAKE)
    spelled = [f"{p.name}:{line}" for p in PATCH_SOURCE.glob("spec_*.py") for line, text in _strings(p)
               if re.match(r"^sglang/srt/.*\.py$", text)]
    assert spelled == [], "a series names an SGLang file itself instead of through common_text"
