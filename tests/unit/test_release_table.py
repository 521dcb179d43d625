"""README's table of every PD release and what protects it is docs/support.md's `protected by` column, folded into
runs of releases (sglang_harden/tools/release_table.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_harden.tools import release_table

REPO = Path(__file__).resolve().parents[2]
SUPPORT = """| release | e2e | protected by | adapter |
|---|---|---|---|
| 0.5.10.post1 |  | series | none |
| 0.5.11 |  | none → 0.5.10.post1 (series) / 0.5.18 (series) | none |
| 0.5.12 |  | none → 0.5.10.post1 (series) / 0.5.18 (series) | none |
| 0.5.18 |  | series | none |
| 0.5.19 | yes | plugin + series | sglang_v05 |
"""


def test_consecutive_releases_with_one_protection_fold_into_a_run() -> None:
    block = release_table.readme_block(SUPPORT)
    assert "| 0.5.11 – 0.5.12 (2) | none | 0.5.10.post1 (series) / 0.5.18 (series) |" in block
    assert "| 0.5.10.post1 | series |  |" in block and "| 0.5.19 | plugin + series |  |" in block
    assert block.count("\n| 0.5.") == 4


def test_a_support_table_without_the_column_is_refused() -> None:
    with pytest.raises(ValueError, match="protected by"):
        release_table.protection_rows("| release | e2e |\n|---|---|\n| 0.5.19 | yes |\n")


def test_readme_block_is_generated_from_docs_support() -> None:
    support = (REPO / "docs" / "support.md").read_text()
    assert release_table.readme_block(support) in (REPO / "README.md").read_text(), (
        "README's release table is stale: python3 -m sglang_harden.tools.release_table")
    rows = release_table.protection_rows(support)
    assert rows[0][0] == "0.4.4.post2" and rows[-1] == ("0.5.23", "plugin + series")
    assert sum(count for _, _, count, _ in release_table.runs(rows)) == len(rows)


def test_every_protection_in_docs_support_is_what_the_series_and_pins_here_say() -> None:
    """Not only the supported pins' rows (tests/integration/test_doctor_wheels.py): a new series or pin changes the
    cells of the releases around it, which the sweep must then be run again for."""
    from sglang_harden.tools.compat_sweep import protection_cell, protection_of, series_pins_here

    series = series_pins_here()
    for release, cell in release_table.protection_rows((REPO / "docs" / "support.md").read_text()):
        assert cell == protection_cell(protection_of(release, series)), (
            f"{release}: docs/support.md says {cell!r}; regenerate it (sglang-harden compat sweep --markdown)")
