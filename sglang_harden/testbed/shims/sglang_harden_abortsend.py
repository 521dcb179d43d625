"""Test hook (test-only): a prefill request is aborted after its forward, before its final KV send.

``SGLANG_HARDEN_TESTBED_ABORT_BEFORE_SEND=<rid prefix>``: in a prefill server, every request whose rid starts
with the prefix gets SGLang's own pending abort (``req.to_finish = FINISH_ABORT(...)``; on 0.4.9
``req.to_abort``) right before the batch
result is processed — what an abort or a rejection arriving while the forward ran looks like. Whether the KV
and "transfer complete" still go out is then up to SGLang (vanilla) or the retire guard (hardened).

Wraps ``SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill``.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

from sglang_harden_shimkit import wrap_methods_once

from sglang_harden._importhook import when_imported

ENV = "SGLANG_HARDEN_TESTBED_ABORT_BEFORE_SEND"
MESSAGE = "aborted by the testbed before the final KV send"


def _mark(batch: Any, prefix: str) -> None:
    for req in getattr(batch, "reqs", None) or []:
        if str(req.rid).startswith(prefix) and not req.finished():
            _abort_pending(req)


def _abort_pending(req: Any) -> None:
    """0.5.x records a pending abort in ``to_finish``; 0.4.9 has no ``to_finish`` and sets ``to_abort``."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    if hasattr(req, "to_finish"):
        if req.to_finish is None:
            req.to_finish = FINISH_ABORT(MESSAGE, 500)
    else:
        req.to_abort, req.to_abort_message = True, MESSAGE


def _wrap(original: Any) -> Any:
    prefix = os.environ[ENV]

    def process_batch_result_disagg_prefill(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        _mark(batch, prefix)
        return original(self, batch, *args, **kwargs)

    return process_batch_result_disagg_prefill


def _patch(module: ModuleType) -> None:
    wrap_methods_once(module.SchedulerDisaggregationPrefillMixin, "_sglang_harden_abortsend",
                      {"process_batch_result_disagg_prefill": _wrap})


def install() -> None:
    when_imported("sglang.srt.disaggregation.prefill", _patch)
