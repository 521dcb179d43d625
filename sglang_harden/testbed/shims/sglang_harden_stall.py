"""Test hook (test-only): a PD scheduler loop stalls, as it does for seconds per loop on a saturated host.

``SGLANG_HARDEN_TESTBED_STALL_DECODE=<trigger path>:<seconds>``: each time the trigger file appears, decode's
``process_decode_queue`` deletes it and sleeps ``seconds`` before going on. Meanwhile the scheduler takes in no
request and answers none; decode's HTTP server (its tokenizer process) keeps running.
``SGLANG_HARDEN_TESTBED_STALL_PREFILL=<trigger path>:<seconds>``: the same on prefill, in
``process_disagg_prefill_inflight_queue`` (the end of each loop of prefill's scheduler; an idle scheduler sleeps
until a request wakes it).
``SGLANG_HARDEN_TESTBED_DELAY_SUCCESS_SYNC=<trigger path>:<seconds>`` (pins whose Mooncake transfer worker syncs a
room's status to decode itself, ``MooncakeKVManager.sync_status_to_decode_endpoint``): each time the trigger file
appears, the worker's next Success sync sleeps ``seconds`` first. Prefill has then concluded the room while its
chunk is still counted in flight, and decode has not heard of the Success yet: the window in which an abort from
decode crosses the Success (a loaded host widens it; this holds it open).
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from sglang_harden_shimkit import append_trace_line, wrap_methods_once

from sglang_harden._importhook import when_imported

ENV = "SGLANG_HARDEN_TESTBED_STALL_DECODE"
PREFILL_ENV = "SGLANG_HARDEN_TESTBED_STALL_PREFILL"
SUCCESS_SYNC_ENV = "SGLANG_HARDEN_TESTBED_DELAY_SUCCESS_SYNC"


def _stalls(env: str, role: str) -> Any:
    path, _, seconds = os.environ[env].rpartition(":")
    trigger, stall_s = Path(path), float(seconds)

    def wrap(original: Any) -> Any:
        @functools.wraps(original)  # keeps an sglang-harden hook's mark: its start-up check still finds the hook
        def stalled_first(self: Any, *args: Any, **kwargs: Any) -> Any:
            if trigger.exists():
                trigger.unlink(missing_ok=True)
                append_trace_line("stall", {"event": "stall", "role": role, "t": time.time(), "seconds": stall_s})
                time.sleep(stall_s)
            return original(self, *args, **kwargs)

        return stalled_first

    return wrap


def _patch_decode(module: ModuleType) -> None:
    wrap_methods_once(module.SchedulerDisaggregationDecodeMixin, "_sglang_harden_stall",
                      {"process_decode_queue": _stalls(ENV, "decode")})


def _patch_prefill(module: ModuleType) -> None:
    wrap_methods_once(module.SchedulerDisaggregationPrefillMixin, "_sglang_harden_stall",
                      {"process_disagg_prefill_inflight_queue": _stalls(PREFILL_ENV, "prefill")})


def _delays_success_sync(original: Any) -> Any:
    path, _, seconds = os.environ[SUCCESS_SYNC_ENV].rpartition(":")
    trigger, delay_s = Path(path), float(seconds)

    @functools.wraps(original)  # keeps an sglang-harden hook's mark (0.5.19 hooks this method too)
    def sync_status(self: Any, remote: Any, dst_port: Any, room: Any, status: Any, *args: Any, **kwargs: Any) -> Any:
        from sglang.srt.disaggregation.base.conn import KVPoll

        if status == KVPoll.Success and trigger.exists():
            trigger.unlink(missing_ok=True)
            append_trace_line("stall", {"event": "success_sync_delayed", "room": int(room), "t": time.time(),
                                        "seconds": delay_s})
            time.sleep(delay_s)
        return original(self, remote, dst_port, room, status, *args, **kwargs)

    return sync_status


def _patch_mooncake(module: ModuleType) -> None:
    if hasattr(module.MooncakeKVManager, "sync_status_to_decode_endpoint"):
        wrap_methods_once(module.MooncakeKVManager, "_sglang_harden_success_sync",
                          {"sync_status_to_decode_endpoint": _delays_success_sync})


def install() -> None:
    if os.environ.get(ENV):
        when_imported("sglang.srt.disaggregation.decode", _patch_decode)
    if os.environ.get(PREFILL_ENV):
        when_imported("sglang.srt.disaggregation.prefill", _patch_prefill)
    if os.environ.get(SUCCESS_SYNC_ENV):
        when_imported("sglang.srt.disaggregation.mooncake.conn", _patch_mooncake)
