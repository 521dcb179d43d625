"""Test hook (test-only): decode's scheduler loop stalls, as it does for seconds per loop on a saturated host.

``SGLANG_HARDEN_TESTBED_STALL_DECODE=<trigger path>:<seconds>``: each time the trigger file appears, decode's
``process_decode_queue`` deletes it and sleeps ``seconds`` before going on. Meanwhile the scheduler takes in no
request and answers none; decode's HTTP server (its tokenizer process) keeps running.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from sglang_harden_shimkit import append_trace_line, wrap_methods_once

from sglang_harden._importhook import when_imported

ENV = "SGLANG_HARDEN_TESTBED_STALL_DECODE"


def _wrap(original: Any) -> Any:
    path, _, seconds = os.environ[ENV].rpartition(":")
    trigger, stall_s = Path(path), float(seconds)

    def process_decode_queue(self: Any, *args: Any, **kwargs: Any) -> Any:
        if trigger.exists():
            trigger.unlink(missing_ok=True)
            append_trace_line("stall", {"event": "stall", "t": time.time(), "seconds": stall_s})
            time.sleep(stall_s)
        return original(self, *args, **kwargs)

    return process_decode_queue


def _patch(module: ModuleType) -> None:
    wrap_methods_once(module.SchedulerDisaggregationDecodeMixin, "_sglang_harden_stall",
                      {"process_decode_queue": _wrap})


def install() -> None:
    when_imported("sglang.srt.disaggregation.decode", _patch)
