"""A late write counts as landed only with a successful status (issue 40): the latewrite shim records the status of
each replayed write; the scenario's judge, the soak's lander and the e2e tests count through one helper."""

from __future__ import annotations

import importlib
import json
import sys
import threading
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from sglang_harden.testbed.client import GenResult, PairResult
from sglang_harden.testbed.latewrite import judge
from sglang_harden.testbed.latewrite_trace import landed, late_writes, replayed, write_counts, write_landed
from sglang_harden.testbed.procenv import SHIMS_DIR


def _write(**fields: Any) -> dict[str, Any]:
    return {"event": "late_write", "room": 42, "t": 50.0, **fields}


@pytest.mark.parametrize(("line", "counts"), [
    (_write(status=0), True),
    (_write(status=-1), False),  # Mooncake's engine call failed
    (_write(status=-1, backend="nixl", state="ERR"), False),
    (_write(), False),  # no status: no evidence
    ({"event": "engine_timeout", "room": 42, "status": 0}, False),
    ({"event": "kv_send", "room": 42, "dst_pages": [1]}, False),
])
def test_a_late_write_landed_only_with_a_successful_status(line: dict[str, Any], counts: bool) -> None:
    assert write_landed(line) is counts


def test_write_counts_report_failed_writes_apart_per_room() -> None:
    lines = [_write(status=0), _write(status=-1), _write(room=43, status=0), {"event": "engine_timeout", "room": 42}]
    assert write_counts(lines) == {"late_writes_attempted": 3, "late_writes_landed": 2, "late_writes_failed": 1}
    assert write_counts(lines, 42) == {"late_writes_attempted": 2, "late_writes_landed": 1, "late_writes_failed": 1}
    assert write_counts([], 42) == {"late_writes_attempted": 0, "late_writes_landed": 0, "late_writes_failed": 0}


def _append(path: Path, *records: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        for record in records:
            fh.write(json.dumps(record) + "\n")


def test_a_failed_write_is_replayed_but_not_landed(tmp_path: Path) -> None:
    _append(tmp_path / "latewrite-1.jsonl", {"event": "kv_send", "room": 42, "dst_pages": [1]}, _write(status=-1))
    assert replayed(tmp_path, 42) and not landed(tmp_path, 42) and not landed(tmp_path)
    _append(tmp_path / "latewrite-2.jsonl", _write(room=43, status=0))
    assert landed(tmp_path) and landed(tmp_path, 43) and not landed(tmp_path, 42)


def _run(victims: list[str]) -> dict[str, Any]:
    ok = GenResult(status=200, body={}, elapsed_s=1.0, output_ids=[1, 2], logprobs=[-0.5, -0.25])
    answer = PairResult(prefill=ok, decode=ok, room=0)
    return {"t0": 0.0, "victims": dict.fromkeys(victims, answer), "ref": answer,
            "pool": {"available_tokens": 340, "max_total_num_tokens": 340}, "misowned": answer}


@pytest.mark.parametrize("status", [0, -1])
def test_judge_counts_only_a_successful_write_as_landed(tmp_path: Path, status: int) -> None:
    """A failed replay is attempted, not landed (no landing time); the victims' changed context rows are summed; a
    victim that decoded over A's pages before the (failed) replay is still named."""
    trace = tmp_path / "kvtrace"
    _append(trace / "latewrite-1.jsonl", {"event": "kv_send", "room": 42, "dst_pages": [100, 101]},
            _write(status=status))
    _append(trace / "kvtrace-1.jsonl",
            {"event": "first_decode", "rid": "B0", "pages": [101], "t": 40.0},
            {"event": "release", "rid": "B0", "context_rows_changed": 3},
            {"event": "first_decode", "rid": "B1", "pages": [7], "t": 60.0},
            {"event": "release", "rid": "B1", "context_rows_changed": 2})
    result = judge(_run(["B0", "B1"]), trace)
    assert result["late_writes_attempted"] == 1
    assert (result["late_writes_landed"], result["late_writes_failed"]) == ((1, 0) if status == 0 else (0, 1))
    assert result["late_write_landed"] is (status == 0)
    assert result["late_write_t_rel"] == (50.0 if status == 0 else None)
    assert result["context_rows_changed"] == 5 and result["corrupted_requests"] == 2
    assert result["handed_a_pages_before_write_landed"] == ["B0"]


def test_judge_without_any_replay_lands_nothing(tmp_path: Path) -> None:
    trace = tmp_path / "kvtrace"
    _append(trace / "latewrite-1.jsonl", {"event": "kv_send", "room": 42, "dst_pages": [100]})
    _append(trace / "kvtrace-1.jsonl", {"event": "first_decode", "rid": "B0", "pages": [100], "t": 40.0},
            {"event": "release", "rid": "B0", "context_rows_changed": 0})
    result = judge(_run(["B0"]), trace)
    assert (result["late_writes_attempted"], result["late_writes_landed"], result["context_rows_changed"]) == (0, 0, 0)
    assert result["handed_a_pages_before_write_landed"] == ["B0"]  # A's write is still held: B0 is exposed


def test_the_shim_records_a_failed_replay_that_does_not_count(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Mooncake: the replayed engine call returns -1; the shim's line carries it and the helper does not count it."""
    monkeypatch.setitem(sys.modules, "sglang", ModuleType("sglang"))
    monkeypatch.setitem(sys.modules, "sglang.version", SimpleNamespace(__version__="0.5.19"))
    monkeypatch.syspath_prepend(str(SHIMS_DIR))
    monkeypatch.setenv("SGLANG_HARDEN_TESTBED_LATE_WRITE", "0.05:42:timeout=0.02")
    monkeypatch.setenv("SGLANG_HARDEN_TESTBED_KVTRACE_DIR", str(tmp_path))
    import sglang_harden_latewrite

    shim = importlib.reload(sglang_harden_latewrite)

    class MooncakeKVManager:
        session_lock = threading.Lock()
        failed_sessions: set[str] = set()
        session_failures: dict[str, int] = {}

        def _transfer_data(self, session_id: str, transfer_blocks: list[int]) -> int:
            return -1  # the engine refused the replayed batch

        def send_kvcache(self, session_id: str, prefill_kv_indices: list[int], dst_kv_ptrs: list[int],
                         dst_kv_indices: list[int], executor: object) -> int:
            return self._transfer_data(session_id, list(prefill_kv_indices))

    shim._patch_manager(SimpleNamespace(MooncakeKVManager=MooncakeKVManager))
    shim._tls.room = 42
    assert MooncakeKVManager().send_kvcache("s", [1, 2], [], [7, 8], None) == -1
    deadline = time.monotonic() + 3
    while not replayed(tmp_path, 42) and time.monotonic() < deadline:
        time.sleep(0.02)
    lines = late_writes(tmp_path)
    assert [w["status"] for w in lines if w["event"] == "late_write"] == [-1]
    assert write_counts(lines, 42) == {"late_writes_attempted": 1, "late_writes_landed": 0, "late_writes_failed": 1}
    assert not landed(tmp_path, 42)
