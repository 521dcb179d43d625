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


def test_mla_refuses_the_ledger_guards_and_names_their_switches() -> None:
    decision = decide_shapes([KVShape.MLA], GUARDS, "pool MLATokenToKVPool")
    assert decision.verdict is Verdict.REJECT
    assert decision.fields["refused"] == ["lifecycle", "page_tags"]
    assert "(mla; pool MLATokenToKVPool)" in decision.reason
    assert "SGLANG_HARDEN_LIFECYCLE=off SGLANG_HARDEN_PAGE_TAGS=off" in decision.reason
    assert "--harden-lifecycle off --harden-page-tags off" in decision.reason
    assert decide_shapes([KVShape.MLA], [g for g in GUARDS if g not in ("lifecycle", "page_tags")]).allows


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


def test_every_refusal_has_a_reason_and_every_in_process_cover_its_tests() -> None:
    for guard, row in shape_table(TABLE_GUARDS):
        for shape, cover in row.items():
            assert cover.why, (guard, shape)
            if cover.cover is Cover.IN_PROCESS:
                assert cover.evidence, (guard, shape)
                for node in cover.evidence:
                    path, _, name = node.partition("::")
                    tree = ast.parse((REPO / path).read_text())
                    names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
                    assert name in names, f"{guard} on {shape.value}: {node} does not exist"


def test_generated_docs_are_current() -> None:
    assert (REPO / "docs" / "shapes.md").read_text() == table_doc.document(), \
        "docs/shapes.md is stale: python3 -m sglang_harden.tools.shape_table"
    readme = (REPO / "README.md").read_text()
    start = readme.index(table_doc.README_BEGIN)
    end = readme.index(table_doc.README_END) + len(table_doc.README_END)
    assert readme[start:end] == table_doc.readme_block(), "README's shapes block is stale"
