"""Plain-text tables for people and progress lines on stderr; the tools' ``--json`` bypasses this."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], max_width: int = 60) -> str:
    """A left-aligned table; cells longer than ``max_width`` are cut with an ellipsis."""
    cells = [[_cell(v, max_width) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, value in enumerate(row):
            widths[i] = max(widths[i], len(value))
    lines = [_join(headers, widths), _join(["-" * w for w in widths], widths)]
    lines += [_join(row, widths) for row in cells]
    return "\n".join(lines)


def _cell(value: object, max_width: int) -> str:
    text = "-" if value is None else str(value)
    text = " ".join(text.split())
    return text if len(text) <= max_width else text[: max_width - 1] + "…"


def _join(values: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)).rstrip()


def dump_json(payload: object) -> str:
    return json.dumps(payload, indent=2, sort_keys=False, default=str)


def progress(message: str) -> None:
    print(f"[sglang-harden] {message}", file=sys.stderr, flush=True)
