"""No module of sglang_harden grows past 500 lines (issue 16): a module that does is doing more than one thing."""

from __future__ import annotations

from pathlib import Path

import sglang_harden

PACKAGE_ROOT = Path(sglang_harden.__file__).resolve().parent
MAX_LINES = 500


def oversized(root: Path = PACKAGE_ROOT, limit: int = MAX_LINES) -> dict[str, int]:
    sizes = {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in root.rglob("*.py")}
    return {name: lines for name, lines in sizes.items() if lines > limit}


def test_finder_counts_lines(tmp_path: Path) -> None:
    (tmp_path / "big.py").write_text("x = 1\n" * 3)
    (tmp_path / "small.py").write_text("x = 1\n")
    assert oversized(tmp_path, limit=2) == {"big.py": 3}


def test_no_module_over_500_lines() -> None:
    assert oversized() == {}
