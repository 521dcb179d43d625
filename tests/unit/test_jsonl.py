"""Trace files read while the shims append to them, and after a run."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_harden.testbed import jsonl


def test_live_reader_leaves_out_a_line_still_being_written(tmp_path: Path) -> None:
    trace = tmp_path / "kvtrace-1.jsonl"
    trace.write_text('{"event": "admitted", "rid": "a"}\n{"event": "first_dec')
    assert jsonl.read_lines(trace, live=True) == [{"event": "admitted", "rid": "a"}]
    with pytest.raises(ValueError):
        jsonl.read_lines(trace)  # after the run every line must be whole


def test_a_broken_complete_line_is_an_error_in_both_modes(tmp_path: Path) -> None:
    trace = tmp_path / "latewrite-1.jsonl"
    trace.write_text('{"event": "kv_send"\n{"event": "late_write"}\n')
    for live in (False, True):
        with pytest.raises(ValueError):
            jsonl.read_lines(trace, live=live)


def test_folder_reads_the_stem_files_in_name_order(tmp_path: Path) -> None:
    (tmp_path / "kvtrace-2.jsonl").write_text('{"n": 2}\n')
    (tmp_path / "kvtrace-1.jsonl").write_text('{"n": 1}\n')
    (tmp_path / "latewrite-1.jsonl").write_text('{"n": 3}\n')
    assert jsonl.read_folder(tmp_path, "kvtrace-") == [{"n": 1}, {"n": 2}]
    assert jsonl.read_folder(tmp_path / "missing", "kvtrace-") == []
