"""The JSON-lines trace files the test-only shims append to (one line per event), read while the servers write
them (``live``) or after a run.

A line without its newline is still being written: a live reader leaves it out. Any other line that is not JSON
raises ``ValueError`` in both modes: a trace that cannot be read is a failed check, never a skipped event.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_lines(path: Path, live: bool = False) -> list[dict[str, Any]]:
    """Every event of one trace file. ``live``: the file may be mid-append (its unterminated last line is left
    out); otherwise the writers are done and every line must be complete."""
    lines = path.read_text().split("\n")
    if live:
        lines = lines[:-1]  # what follows the last newline: nothing, or a line still being written
    return [json.loads(line) for line in lines if line.strip()]


def read_folder(folder: Path, stem: str, live: bool = False) -> list[dict[str, Any]]:
    """The events of every ``<stem>*.jsonl`` in ``folder``, file by file in name order (none without the
    folder)."""
    folder = Path(folder)
    if not folder.exists():
        return []
    return [event for path in sorted(folder.glob(f"{stem}*.jsonl")) for event in read_lines(path, live)]
