"""Hook table for SGLang 0.5.19 … 0.5.23 (one family: same module layout and hook signatures).

Everything here translates between SGLang objects and the plain views of ``sglang_harden.guards``, and applies
decisions through SGLang's own abort paths (``prepare_abort`` + ``stream_output``, ``KVSender.abort``, the
receiver's failure state). No decision logic lives here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sglang_harden import events
from sglang_harden.compat import lifecycle_v05
from sglang_harden.compat.hooks import Hook, missing
from sglang_harden.compat.runtime import RUNTIME, HardenRefusal
from sglang_harden.compat.shared import (
    TOKENIZER,
    RequestReader,
    bootstrap_base_url,
    bootstrap_routes,
    capacity_gate,
    door,
    in_scheduler,
    peer_status_abort,
    publish_retired_abort,
    retire_final_send,
    role_of,
    tokenization_refusal,
    tokenizer_learns_limit,
    validation_refusal,
    watch_receiver,
)
from sglang_harden.guards import coverage
from sglang_harden.guards.admission import PendingRejection

logger = logging.getLogger("sglang_harden")

FAMILY = "sglang-0.5.19+"
PREFILL = "sglang.srt.disaggregation.prefill"
DECODE = "sglang.srt.disaggregation.decode"
UTILS = "sglang.srt.disaggregation.utils"
CONN = "sglang.srt.disaggregation.common.conn"
SCHEDULER = "sglang.srt.managers.scheduler"
COVERAGE_SLOT = 15  # cached_tokens[idx][15]: spare in this family (slots 0-6 are used upstream)

Func = Callable[..., Any]


# ---------------------------------------------------------------- reading SGLang objects


def pending_rejection(req: Any) -> PendingRejection | None:
    """The abort SGLang already decided for ``req`` (``to_finish`` or ``finished_reason``), if any."""
    for attr in ("to_finish", "finished_reason"):
        reason = getattr(req, attr, None)
        if reason is not None and type(reason).__name__ == "FINISH_ABORT":
            status = getattr(reason, "status_code", None)
            return PendingRejection(str(reason.message), int(status or 400))
    return None


def _abort_and_stream(scheduler: Any, req: Any, message: str, status_code: int) -> None:
    from sglang.srt.disaggregation.utils import prepare_abort

    prepare_abort(req, message, status_code=status_code)
    if hasattr(req, "to_finish"):
        req.to_finish = None
    scheduler.output_streamer.stream_output([req], req.return_logprob)


def _is_aborted(req: Any) -> bool:
    from sglang.srt.disaggregation.utils import is_aborted

    return bool(is_aborted(req))


READER = RequestReader(pending_rejection, _is_aborted, _abort_and_stream)


def _door(role: str) -> Callable[[Func], Func]:
    return door(role, READER)


_retire_final_send = retire_final_send(READER)


# ---------------------------------------------------------------- coverage


def _publish_coverage(original: Func) -> Func:
    def set_buf(self: Any, req: Any) -> Any:
        result = original(self, req)
        room = int(req.bootstrap_room or 0)
        self.cached_tokens[req.metadata_buffer_index][COVERAGE_SLOT] = coverage.encode_coverage(
            len(req.origin_input_ids), room
        )
        return result

    return set_buf


def _check_coverage(original: Func) -> Func:
    def commit(self: Any, decode_req: Any) -> Any:
        req = decode_req.req
        if _is_fake_transfer(req):
            return original(self, decode_req)
        room = int(req.bootstrap_room or 0)
        raw = int(self.metadata_buffers.cached_tokens[decode_req.metadata_buffer_index][COVERAGE_SLOT])
        sent = coverage.decode_coverage(raw, room)
        decision = coverage.decide_commit(str(req.rid), len(req.origin_input_ids), sent)
        if events.record(decision, RUNTIME.config.coverage, room=room):
            from sglang.srt.disaggregation.utils import prepare_abort

            prepare_abort(req, decision.reason, status_code=decision.status_code)
            decode_req.kv_receiver.clear()
            decode_req.kv_receiver = None
            return None
        return original(self, decode_req)

    return commit


def _is_fake_transfer(req: Any) -> bool:
    """SGLang's own warm-up pairs decode with an in-process fake transfer that sends no KV at all."""
    from sglang.srt.disaggregation.utils import _is_fake_transfer as is_fake

    return bool(is_fake(req))


# ---------------------------------------------------------------- abort notification


# ---------------------------------------------------------------- start-up: capacity gate, verification


def _scheduler_started(original: Func) -> Func:
    def init(self: Any, server_args: Any, port_args: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, server_args, port_args, *args, **kwargs)
        role = role_of(self)
        _verify_in_process(role, str(getattr(server_args, "disaggregation_transfer_backend", "")))
        capacity_gate(self)
        if role == "prefill":
            RUNTIME.start_publisher(bootstrap_base_url(self))
        RUNTIME.log_active(role=f"scheduler/{role}")
        return result

    return init


def _report_state(original: Func) -> Func:
    """``/server_info`` gains ``internal_states[i].sglang_harden``: pool occupancy, armed guards, decisions."""

    def get_internal_state(self: Any, recv_req: Any) -> Any:
        output = original(self, recv_req)
        state = getattr(output, "internal_state", None)
        if isinstance(state, dict):
            state["sglang_harden"] = pool_report(self)
        return output

    return get_internal_state


def pool_report(scheduler: Any) -> dict[str, Any]:
    allocator = scheduler.token_to_kv_pool_allocator
    evictable = scheduler.tree_cache.evictable_size() if scheduler.tree_cache is not None else 0
    return {
        "pin": RUNTIME.pin,
        "family": RUNTIME.family,
        "role": role_of(scheduler),
        "guards": list(RUNTIME.armed),
        "max_total_num_tokens": int(scheduler.max_total_num_tokens),
        "available_tokens": int(allocator.available_size()),
        "evictable_tokens": int(evictable),
        "max_req_input_len": int(scheduler.max_req_input_len),
        "context_len": int(scheduler.model_config.context_len),
        "decisions": events.snapshot(),
        "lifecycle": lifecycle_v05.node_report(),
    }


def _needed_here(hook: Hook, role: str, backend: str) -> bool:
    in_role = role in ROLES_BY_OWNER.get(hook.owner, {role})
    return in_role and in_scheduler(hook) and lifecycle_v05.needed_on_backend(hook, backend)


def _verify_in_process(role: str, backend: str) -> None:
    from sglang_harden.compat.hooks import registered_hooks

    unsupported = lifecycle_v05.check_backend(role, backend)
    if unsupported:
        raise HardenRefusal(unsupported)
    needed = [h for h in registered_hooks() if _needed_here(h, role, backend)]
    gaps = missing(needed)
    if gaps:
        raise HardenRefusal("sglang-harden: hooks missing in this process: " + "; ".join(gaps))


# ---------------------------------------------------------------- the table

# Pins whose prefill retires an aborted result itself (skipping the final send, never telling decode).
RETIRES_ABORTED_RESULT = ("0.5.20", "0.5.21", "0.5.23")


def _retired_result_hooks() -> list[Hook]:
    if RUNTIME.pin not in RETIRES_ABORTED_RESULT:
        return []
    return [Hook("abort_notify", PREFILL, "SchedulerDisaggregationPrefillMixin._retire_aborted_prefill_result",
                 ("self", "req"), publish_retired_abort(READER))]



HOOKS: list[Hook] = [
    Hook("admission", PREFILL, "PrefillBootstrapQueue.add", ("self", "req", "num_kv_heads"),
         _door("prefill")),
    Hook("admission", DECODE, "DecodePreallocQueue.add", ("self", "req", "is_retracted"),
         _door("decode")),
    Hook("retire", PREFILL, "SchedulerDisaggregationPrefillMixin.send_kv_chunk",
         ("self", "req", "last_chunk", "end_idx"), _retire_final_send),
    Hook("coverage", UTILS, "MetadataBuffers.set_buf", ("self", "req"), _publish_coverage),
    Hook("coverage", DECODE, "DecodeTransferQueue._commit_transfer_to_req", ("self", "decode_req"),
         _check_coverage),
    Hook("abort_notify", CONN, "CommonKVBootstrapServer._setup_routes", ("self",), bootstrap_routes),
    Hook("abort_notify", CONN, "CommonKVReceiver.__init__", ("self", "mgr", "bootstrap_addr", "bootstrap_room"),
         watch_receiver),
    Hook("abort_notify", DECODE, "prepare_abort", ("req", "error_message", "status_code"), peer_status_abort),
    *_retired_result_hooks(),
    Hook("abort_notify", TOKENIZER, "TokenizerManager._validate_one_request", ("self", "obj", "input_ids"),
         validation_refusal),
    Hook("abort_notify", TOKENIZER, "TokenizerManager._tokenize_one_request", ("self", "obj"),
         tokenization_refusal),
    Hook("startup", SCHEDULER, "Scheduler.__init__", ("self", "server_args", "port_args"), _scheduler_started),
    Hook("startup", SCHEDULER, "Scheduler.get_internal_state", ("self", "recv_req"), _report_state),
    *lifecycle_v05.HOOKS,
]

# Which scheduler roles must have each owner's hooks in place ("null" = no disaggregation).
ROLES_BY_OWNER: dict[str, set[str]] = {
    "admission": {"prefill", "decode"},
    "retire": {"prefill"},
    "coverage": {"prefill", "decode"},
    "abort_notify": {"decode"},
    "startup": {"prefill", "decode", "null"},
    **lifecycle_v05.ROLES,
}

MODULE_CALLBACKS: dict[str, Callable[[Any], None]] = {TOKENIZER: tokenizer_learns_limit}
