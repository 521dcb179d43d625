"""Each guard module opens with its invariant: a paragraph starting "Invariant:", at most 10 lines (issue 16), so a
reader learns what the guard promises before how it keeps the promise."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import sglang_harden.guards

GUARDS_DIR = Path(sglang_harden.guards.__file__).resolve().parent
NOT_GUARDS = {"__init__.py", "base.py"}
MAX_LINES = 10


def invariant_paragraph(docstring: str) -> list[str]:
    lines = docstring.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Invariant:")), None)
    if start is None:
        return []
    paragraph = []
    for line in lines[start:]:
        if not line.strip():
            break
        paragraph.append(line)
    return paragraph


def test_paragraph_reader() -> None:
    assert invariant_paragraph("Title.\n\nInvariant: a\nb\n\nMore.") == ["Invariant: a", "b"]
    assert invariant_paragraph("Title only.") == []


@pytest.mark.parametrize("path", sorted(p for p in GUARDS_DIR.glob("*.py") if p.name not in NOT_GUARDS),
                         ids=lambda p: p.stem)
def test_guard_states_its_invariant_briefly(path: Path) -> None:
    paragraph = invariant_paragraph(ast.get_docstring(ast.parse(path.read_text())) or "")
    assert paragraph, f"{path.name}: no 'Invariant:' paragraph in the module docstring"
    assert len(paragraph) <= MAX_LINES, f"{path.name}: invariant takes {len(paragraph)} lines"
