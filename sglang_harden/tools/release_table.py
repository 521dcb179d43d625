"""README's table of every SGLang release with PD disaggregation and what protects it, in runs of releases.

Read from ``docs/support.md`` (``compat sweep --markdown``, which reads every release's code): its ``protected by``
column, consecutive releases with the same cell folded into one row, so the README stays short.

    python3 -m sglang_harden.tools.release_table      rewrite README's block from docs/support.md
"""

from __future__ import annotations

import sys
from pathlib import Path

README_BEGIN = "<!-- releases:begin (generated: python3 -m sglang_harden.tools.release_table) -->"
README_END = "<!-- releases:end -->"
REPO = Path(__file__).resolve().parents[2]
COLUMN = "protected by"


def protection_rows(support_md: str) -> list[tuple[str, str]]:
    """(release, protected-by cell) for each row of docs/support.md's table, in its order (oldest first)."""
    header: list[str] | None = None
    rows: list[tuple[str, str]] = []
    for line in support_md.splitlines():
        if not line.startswith("| "):
            continue
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            if "release" not in header or COLUMN not in header:
                raise ValueError(f"docs/support.md's table has no 'release' and '{COLUMN}' columns: {header}")
            continue
        rows.append((cells[header.index("release")], cells[header.index(COLUMN)]))
    if not rows:
        raise ValueError("docs/support.md has no release rows (regenerate it: sglang-harden compat sweep --markdown)")
    return rows


def runs(rows: list[tuple[str, str]]) -> list[tuple[str, str, int, str]]:
    """(first, last, count, cell) for each run of consecutive releases with the same protection."""
    folded: list[tuple[str, str, int, str]] = []
    for release, cell in rows:
        if folded and folded[-1][3] == cell:
            first, _, count, _ = folded[-1]
            folded[-1] = (first, release, count + 1, cell)
        else:
            folded.append((release, release, 1, cell))
    return folded


def readme_block(support_md: str) -> str:
    lines = ["| releases | protected by | nearest protected (older / newer) |", "|---|---|---|"]
    for first, last, count, cell in runs(protection_rows(support_md)):
        span = first if count == 1 else f"{first} – {last} ({count})"
        verdict, _, nearest = cell.partition(" → ")
        lines.append(f"| {span} | {verdict} | {nearest} |")
    return "\n".join([README_BEGIN, *lines, README_END])


def write_readme(repo: Path = REPO) -> None:
    support = (repo / "docs" / "support.md").read_text()
    readme = repo / "README.md"
    text = readme.read_text()
    start, end = text.index(README_BEGIN), text.index(README_END) + len(README_END)
    readme.write_text(text[:start] + readme_block(support) + text[end:])


if __name__ == "__main__":
    write_readme(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO)
