"""The model-shape gate's rule and the table generated from it (docs/shapes.md, README)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sglang_harden.config import GUARDS
from sglang_harden.guards.base import Verdict
from sglang_harden.guards.model_shape import (
    PAGE_AND_BYTE_GUARDS,
    Cover,
    KVShape,
    coverage,
    decide_shapes,
    shape_table,
)
from sglang_harden.tools import shape_table as table_doc

REPO = Path(__file__).resolve().parents[2]
TABLE_GUARDS = table_doc.TABLE_GUARDS  # every guard and the capacity gate


def test_the_testbeds_shape_allows_every_guard() -> None:
    decision = decide_shapes([KVShape.MHA], GUARDS)
    assert decision.verdict is Verdict.ALLOW
    assert decision.fields["guards"]["lifecycle"] == {"mha": "e2e"}


def test_mla_allows_every_guard_each_with_its_evidence() -> None:
    decision = decide_shapes([KVShape.MLA], GUARDS, "pool MLATokenToKVPool")
    assert decision.verdict is Verdict.ALLOW
    assert decision.fields["guards"]["lifecycle"] == decision.fields["guards"]["page_tags"] == {"mla": "e2e"}
    assert decision.fields["guards"]["canary"] == {"mla": "e2e"}


def test_a_refusal_names_the_shape_the_guards_and_their_switches() -> None:
    decision = decide_shapes([KVShape.MLA, KVShape.SPECULATIVE], GUARDS, "pool MLATokenToKVPool; EAGLE")
    assert decision.verdict is Verdict.REJECT
    assert decision.fields["refused"] == ["canary", "checksum", "lifecycle", "page_tags"]
    assert "(mla, speculative; pool MLATokenToKVPool; EAGLE)" in decision.reason
    assert "lifecycle on speculative" in decision.reason and "on mla" not in decision.reason
    assert ("SGLANG_HARDEN_CANARY=off SGLANG_HARDEN_CHECKSUM=off SGLANG_HARDEN_LIFECYCLE=off "
            "SGLANG_HARDEN_PAGE_TAGS=off") in decision.reason
    assert "--harden-lifecycle off --harden-page-tags off" in decision.reason


@pytest.mark.parametrize("shape", [s for s in KVShape if s not in (KVShape.MHA, KVShape.MLA)])
def test_shapes_beyond_mla_refuse_every_page_and_byte_guard(shape: KVShape) -> None:
    decision = decide_shapes([KVShape.MHA, shape], GUARDS)
    assert decision.verdict is Verdict.REJECT and decision.fields["refused"] == sorted(PAGE_AND_BYTE_GUARDS)
    assert decide_shapes([KVShape.MHA, shape], [g for g in GUARDS if g not in PAGE_AND_BYTE_GUARDS]).allows


def test_guards_that_read_no_page_are_never_refused() -> None:
    independent = [g for g in TABLE_GUARDS if g not in PAGE_AND_BYTE_GUARDS]
    for shape in KVShape:
        for guard in independent:
            assert coverage(shape, guard).cover in (Cover.E2E, Cover.INDEPENDENT), (shape, guard)
    assert decide_shapes(list(KVShape), independent).allows


def test_no_guard_armed_decides_nothing_to_refuse() -> None:
    assert decide_shapes(list(KVShape), []).allows


def test_every_refusal_has_a_reason_and_every_cover_beyond_mha_its_tests() -> None:
    for guard, row in shape_table(TABLE_GUARDS):
        for shape, cover in row.items():
            assert cover.why, (guard, shape)
            if cover.cover is Cover.IN_PROCESS or (cover.cover is Cover.E2E and shape is not KVShape.MHA):
                assert cover.evidence, (guard, shape)
            if cover.evidence:  # a refusal may cite the real node refusing it too
                proven_by = set()
                for node in cover.evidence:
                    path, _, name = node.partition("::")
                    tests = {n.name: n for n in ast.walk(ast.parse((REPO / path).read_text()))
                             if isinstance(n, ast.FunctionDef)}
                    assert name in tests, f"{guard} on {shape.value}: {node} does not exist"
                    proven_by |= _proves_guards(tests[name]) if path.startswith("tests/e2e/") else set()
                if cover.cover is Cover.E2E:
                    assert guard in proven_by, f"{guard} on {shape.value}: no e2e test it cites proves it"


def _proves_guards(test: ast.FunctionDef) -> set[str]:
    """The guards a test's ``@pytest.mark.proves(path, *guards, ...)`` names."""
    return {arg.value for mark in test.decorator_list if isinstance(mark, ast.Call)
            and isinstance(mark.func, ast.Attribute) and mark.func.attr == "proves"
            for arg in mark.args[1:] if isinstance(arg, ast.Constant)}


def test_generated_docs_are_current() -> None:
    assert (REPO / "docs" / "shapes.md").read_text() == table_doc.document(), \
        "docs/shapes.md is stale: python3 -m sglang_harden.tools.shape_table"
    readme = (REPO / "README.md").read_text()
    start = readme.index(table_doc.README_BEGIN)
    end = readme.index(table_doc.README_END) + len(table_doc.README_END)
    assert readme[start:end] == table_doc.readme_block(), "README's shapes block is stale"
