"""Hook table for SGLang 0.4.9.post6 (the oldest supported pin: no plugin API, no ``is_aborted``).

Same guards as ``sglang_v05``, on this pin's names: output goes through ``Scheduler.stream_output``;
``Req.set_finish_with_abort`` writes ``finished_reason`` directly and stubs the prompt to one token;
an abort requested while a request runs sets ``req.to_abort``; there is no ``_commit_transfer_to_req``,
so the coverage check sits on ``DecodeTransferQueue.pop_transferred``'s result (before a transferred
request joins the waiting queue, i.e. before any decode step reads its pages); Mooncake has its own
bootstrap-server and receiver classes, which carry the abort side channel. Activation: the launcher and
its start-up hook only. No decision logic lives here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sglang_harden import events
from sglang_harden.compat.hooks import Hook, missing
from sglang_harden.compat.internals import (
    DECODE,
    DECODE_DOOR,
    MOONCAKE,
    POP_TRANSFERRED,
    PREFILL,
    PREFILL_DOOR,
    SCHEDULER,
    UTILS,
)
from sglang_harden.compat.model_shape import shape_gate
from sglang_harden.compat.runtime import RUNTIME, HardenRefusal
from sglang_harden.compat.shared import (
    TOKENIZER,
    RequestReader,
    abort_routes,
    bootstrap_base_url,
    capacity_gate,
    door,
    in_scheduler,
    peer_status_abort,
    pending_rejection,
    report_state,
    retire_final_send,
    role_of,
    tokenization_refusal,
    tokenizer_learns_limit,
    validation_refusal,
    watch_receiver,
)
from sglang_harden.config import Mode
from sglang_harden.guards import coverage
from sglang_harden.guards.base import Decision

logger = logging.getLogger("sglang_harden")

FAMILY = "sglang-0.4.9"
COVERAGE_SLOT = 15  # output_ids[idx][15]: this pin writes only output_ids[idx][0]; 1..15 are RDMA padding
FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # SGLang's warm-up pairs decode with an in-process fake transfer (no KV)
ABORT_NOTIFY_BACKENDS = ("mooncake",)

Func = Callable[..., Any]


# ---------------------------------------------------------------- reading SGLang objects


def is_aborted(req: Any) -> bool:
    """An abort not yet turned into a finish: 0.4.9's ``to_abort`` (``AbortReq`` on a running request), or an abort
    pending in ``to_finish`` (releases from 0.5.4.post2, which the unknown-pin override may still hand this family)."""
    pending = getattr(req, "to_finish", None)
    return bool(getattr(req, "to_abort", False)) or type(pending).__name__ == "FINISH_ABORT"


def _abort_and_stream(scheduler: Any, req: Any, message: str, status_code: int) -> None:
    from sglang.srt.disaggregation.utils import prepare_abort

    prepare_abort(req, message, status_code=status_code)
    if getattr(req, "to_finish", None) is not None:
        req.to_finish = None  # ours is the finish now (later releases apply to_finish over finished_reason)
    _stream(scheduler, req)


def _stream(scheduler: Any, req: Any) -> None:
    streamer = getattr(scheduler, "output_streamer", None)  # 0.5.x moved stream_output onto it
    (streamer.stream_output if streamer is not None else scheduler.stream_output)([req], req.return_logprob)


READER = RequestReader(pending_rejection, is_aborted, _abort_and_stream)


def _door(role: str) -> Callable[[Func], Func]:
    return door(role, READER)


_retire_final_send = retire_final_send(READER)


# ---------------------------------------------------------------- coverage


def _publish_coverage(original: Func) -> Func:
    """Prefill: next to the first output token, say how many tokens of KV were sent for this room."""

    def set_buf(self: Any, req: Any) -> Any:
        result = original(self, req)
        sent = int(getattr(req, "start_send_idx", len(req.origin_input_ids)))
        value = coverage.encode_coverage(sent, int(req.bootstrap_room or 0))
        self.output_ids[req.metadata_buffer_index][COVERAGE_SLOT] = value
        return result

    return set_buf


def _check_coverage(original: Func) -> Func:
    """Decode: every request ``pop_transferred`` hands over must have received KV for all it reserved."""

    def pop_transferred(self: Any, *args: Any, **kwargs: Any) -> Any:
        slots = {id(d.req): d.metadata_buffer_index for d in self.queue}
        transferred = original(self, *args, **kwargs)
        return [req for req in transferred if _commit_allowed(self, req, slots.get(id(req)))]

    return pop_transferred


def _commit_allowed(queue: Any, req: Any, slot: int | None) -> bool:
    """Read the coverage prefill published (still in the just-freed metadata slot) and decide."""
    if getattr(req, "bootstrap_host", None) == FAKE_BOOTSTRAP_HOST:
        return True
    room = int(req.bootstrap_room or 0)
    sent = None
    if slot is not None and slot >= 0:
        sent = coverage.decode_coverage(int(queue.metadata_buffers.output_ids[slot][COVERAGE_SLOT]), room)
    decision = coverage.decide_commit(str(req.rid), len(req.origin_input_ids), sent)
    if not events.record(decision, RUNTIME.config.coverage, room=room):
        return True
    _abort_transferred(queue, req, decision)
    return False


def _abort_transferred(queue: Any, req: Any, decision: Decision) -> None:
    """SGLang's own transfer-failure path: abort, answer the client, release the pages."""
    from sglang.srt.disaggregation import decode

    decode.prepare_abort(req, decision.reason, status_code=decision.status_code)
    _stream(queue.scheduler, req)
    queue.tree_cache.cache_finished_req(req)


# ---------------------------------------------------------------- abort notification


# ---------------------------------------------------------------- start-up: shape and capacity gates, verification


def _scheduler_started(original: Func) -> Func:
    def init(self: Any, server_args: Any, port_args: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, server_args, port_args, *args, **kwargs)
        role = role_of(self)
        _verify_in_process(role, str(getattr(server_args, "disaggregation_transfer_backend", "")))
        shape_gate(self, role, ROLES_BY_OWNER)
        capacity_gate(self)
        if role == "prefill":
            RUNTIME.start_publisher(bootstrap_base_url(self))
        RUNTIME.log_active(role=f"scheduler/{role}")
        return result

    return init


def _verify_in_process(role: str, backend: str) -> None:
    """Refuse to serve if a hook this role needs is not in place here, or cannot work on this backend."""
    if role == "decode" and RUNTIME.config.abort_notify is not Mode.OFF and backend not in ABORT_NOTIFY_BACKENDS:
        raise HardenRefusal(
            f"sglang-harden on SGLang 0.4.9: abort notification supports the {'/'.join(ABORT_NOTIFY_BACKENDS)} "
            f"transfer backend, not {backend!r}; use mooncake or start with --harden-abort-notify off"
        )
    needed = [h for h in HOOKS if role in ROLES_BY_OWNER.get(h.owner, {role}) and _armed(h.owner) and in_scheduler(h)]
    gaps = missing(needed)
    if gaps:
        raise HardenRefusal("sglang-harden: hooks missing in this process: " + "; ".join(gaps))


def _armed(owner: str) -> bool:
    """Hooks of a guard configured ``off`` are never registered, so they are not expected in place."""
    return owner == "startup" or RUNTIME.config.mode(owner) is not Mode.OFF


# ---------------------------------------------------------------- the table

HOOKS: list[Hook] = [
    Hook("admission", *PREFILL_DOOR, ("self", "req", "num_kv_heads"), _door("prefill")),
    Hook("admission", *DECODE_DOOR, ("self", "req", "is_retracted"), _door("decode")),
    Hook("retire", PREFILL, "SchedulerDisaggregationPrefillMixin.send_kv_chunk",
         ("self", "req", "last_chunk", "end_idx"), _retire_final_send),
    Hook("coverage", UTILS, "MetadataBuffers.set_buf", ("self", "req"), _publish_coverage),
    Hook("coverage", *POP_TRANSFERRED, ("self",), _check_coverage),
    Hook("abort_notify", MOONCAKE, "MooncakeKVBootstrapServer._setup_routes", ("self",), abort_routes),
    Hook("abort_notify", MOONCAKE, "MooncakeKVReceiver.__init__",
         ("self", "mgr", "bootstrap_addr", "bootstrap_room"), watch_receiver),
    Hook("abort_notify", DECODE, "prepare_abort", ("req", "error_message", "status_code"), peer_status_abort),
    Hook("abort_notify", TOKENIZER, "TokenizerManager._validate_one_request", ("self", "obj", "input_ids"),
         validation_refusal),
    Hook("abort_notify", TOKENIZER, "TokenizerManager._tokenize_one_request", ("self", "obj"),
         tokenization_refusal),
    Hook("startup", SCHEDULER, "Scheduler.__init__", ("self", "server_args", "port_args"), _scheduler_started),
    Hook("startup", SCHEDULER, "Scheduler.get_internal_state", ("self", "recv_req"), report_state()),
]

# Which scheduler roles must have each owner's hooks in place ("null" = no disaggregation).
ROLES_BY_OWNER: dict[str, set[str]] = {
    "admission": {"prefill", "decode"},
    "retire": {"prefill"},
    "coverage": {"prefill", "decode"},
    "abort_notify": {"decode"},
    "startup": {"prefill", "decode", "null"},
}

MODULE_CALLBACKS: dict[str, Callable[[Any], None]] = {TOKENIZER: tokenizer_learns_limit}
