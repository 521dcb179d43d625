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
from sglang_harden.compat import (
    backends,
    commit_chain,
    commit_gate,
    control_auth,
    deferred_release_v05,
    hook_timer,
    kv_canary,
    kv_digest,
    lifecycle_v05,
    page_tags_v05,
    zmq_channels,
    zmq_listeners,
)
from sglang_harden.compat.abort_v05 import abort_and_stream, is_aborted
from sglang_harden.compat.backends import check_backend, needed_on_backend
from sglang_harden.compat.hooks import Hook, missing
from sglang_harden.compat.internals import (
    CONN,
    DECODE,
    DECODE_DOOR,
    PREFILL,
    PREFILL_DOOR,
    SCHEDULER,
    SETUP_ROUTES,
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
    digest_routes,
    door,
    front_answers_refusals,
    in_scheduler,
    peer_status_abort,
    pending_rejection,
    prefill_front_door,
    publish_peer_abort,
    publish_retired_abort,
    report_state,
    retire_final_send,
    role_of,
    room_of,
    tokenization_refusal,
    tokenizer_learns_limit,
    validation_refusal,
    watch_receiver,
)
from sglang_harden.config import Mode
from sglang_harden.guards import abort_notify, coverage
from sglang_harden.guards.base import Decision, Verdict

logger = logging.getLogger("sglang_harden")

FAMILY = "sglang-0.5.19+"
COVERAGE_SLOT = 15  # cached_tokens[idx][15]: spare in this family (slots 0-6 are used upstream)

Func = Callable[..., Any]


# ---------------------------------------------------------------- reading SGLang objects


READER = RequestReader(pending_rejection, is_aborted, abort_and_stream)


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


def _coverage_step(queue: Any, decode_req: Any, _context: dict[str, Any]) -> bool:
    """Commit-chain step: refuse a transfer that covered fewer tokens than decode reserved."""
    req = decode_req.req
    if _is_fake_transfer(req):
        return False
    room = int(req.bootstrap_room or 0)
    raw = int(queue.metadata_buffers.cached_tokens[decode_req.metadata_buffer_index][COVERAGE_SLOT])
    sent = coverage.decode_coverage(raw, room)
    decision = coverage.decide_commit(str(req.rid), len(req.origin_input_ids), sent)
    if events.record(decision, RUNTIME.config.coverage, room=room):
        _abort_transferred(queue, decode_req, decision)
        return True
    return False


def _abort_transferred(_queue: Any, decode_req: Any, decision: Decision) -> None:
    """Decode gives up a finished transfer before commit: SGLang's abort, the receiver cleared and dropped."""
    from sglang.srt.disaggregation.utils import prepare_abort

    prepare_abort(decode_req.req, decision.reason, status_code=decision.status_code)
    decode_req.kv_receiver.clear()
    decode_req.kv_receiver = None


def _is_fake_transfer(req: Any) -> bool:
    """SGLang's own warm-up pairs decode with an in-process fake transfer that sends no KV at all."""
    from sglang.srt.disaggregation.utils import _is_fake_transfer as is_fake

    return bool(is_fake(req))


# ---------------------------------------------------------------- checksum


def _sent_range(_scheduler: Any, req: Any, end_idx: Any) -> tuple[int, int]:
    """Tokens whose KV prefill sends for ``req`` in all: from decode's cached prefix to the last chunk's end
    (0.5.23 names the forward's end ``extend_end``, earlier pins ``extend_range.end``)."""
    if end_idx is None:
        extend_end = getattr(req, "extend_end", None)
        end_idx = extend_end if extend_end is not None else req.extend_range.end
        end_idx = min(int(end_idx), len(req.origin_input_ids))
    return int(getattr(req, "disagg_decode_prefix_len", 0) or 0), int(end_idx)


DIGEST_READER = kv_digest.DigestReader(
    pool_row=lambda req: int(req.kv.req_pool_idx),
    sent_range=_sent_range,
    is_fake_transfer=_is_fake_transfer,
    abort_transferred=_abort_transferred,
)


# ---------------------------------------------------------------- abort notification


def _publish_bootstrap_failure(original: Func) -> Func:
    """Prefill's handshake for a request failed (the client hung up, a bootstrap error): decode, which holds
    pages for it, is told at once instead of waiting out its own timeout (and then SGLang's deferred-release
    timeout, 30 s more). Whether a KV chunk of the room was ever queued is read before SGLang frees the
    request's pages, which ends the lifecycle node's record of the room."""

    def handle_bootstrap_failure(self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        room = room_of(req)
        queued = room is None or _chunks_may_be_queued(self, room)
        result = original(self, req, *args, **kwargs)
        reason = getattr(getattr(req, "finished_reason", None), "message", None) or "bootstrap failed"
        decision = abort_notify.decide_on_bootstrap_failure(str(req.rid), room, str(reason), queued)
        if events.record(decision, RUNTIME.config.abort_notify, role="prefill"):
            publish_peer_abort(room, decision, sent_kv=queued)
        return result

    return handle_bootstrap_failure


def _chunks_may_be_queued(scheduler: Any, room: int) -> bool:
    """False only when this prefill is one rank (no other rank's chunks to vouch for) and its lifecycle node
    saw no chunk of ``room`` handed to the transfer engine."""
    if int(getattr(scheduler, "tp_size", 1) or 1) > 1:
        return True
    return lifecycle_v05.chunks_queued(room)


def _release_when_never_written(original: Func) -> Func:
    """SGLang's deferred KV release holds an aborted room's pages until prefill acks that its writes drained.
    A prefill that failed the room during its handshake never acks (its sender is gone) and said so on the abort
    board: release then, instead of after the 30 s deferred-release timeout."""

    def is_abort_release_safe(self: Any, bootstrap_room: int, required_acks: int, *args: Any, **kwargs: Any) -> Any:
        if original(self, bootstrap_room, required_acks, *args, **kwargs):
            return True
        watcher = RUNTIME.watcher
        hit = watcher.hit(int(bootstrap_room)) if watcher is not None else None
        decision = abort_notify.decide_on_pending_release(int(bootstrap_room), hit.sent_kv if hit else None)
        if decision.verdict is not Verdict.RELEASE:  # asked on every loop while held: only a release is news
            return False
        events.record(decision, RUNTIME.config.abort_notify, room=bootstrap_room)
        return RUNTIME.config.abort_notify is Mode.ENFORCE

    return is_abort_release_safe


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
        if role == "decode":
            RUNTIME.decode_kv_pool = self.token_to_kv_pool_allocator.get_kvcache()
        RUNTIME.log_active(role=f"scheduler/{role}")
        control_auth.warn_if_unauthenticated(role)
        return result

    return init


def _family_report() -> dict[str, Any]:
    return {
        "lifecycle": lifecycle_v05.node_report(),
        "digest_time": kv_digest.TIMER.report(),
        "hook_time": hook_timer.TIMER.report(),
    }


def _needed_here(hook: Hook, role: str, backend: str) -> bool:
    in_role = role in ROLES_BY_OWNER.get(hook.owner, {role})
    return in_role and in_scheduler(hook) and needed_on_backend(hook, backend)


def _guards_needing_a_backend(role: str) -> list[str]:
    """The guards armed in this role that read ledgers the backends' hooks keep."""
    wanted = [("lifecycle", {"prefill", "decode"}), ("page_tags", {"decode"})]
    return [guard for guard, roles in wanted if guard in RUNTIME.armed and role in roles]


def _verify_in_process(role: str, backend: str) -> None:
    from sglang_harden.compat.hooks import registered_hooks

    unsupported = check_backend(role, backend, _guards_needing_a_backend(role))
    if unsupported:
        raise HardenRefusal(unsupported)
    needed = [h for h in registered_hooks() if _needed_here(h, role, backend)]
    gaps = missing(needed)
    if "bootstrap_auth" in RUNTIME.armed and role in ("prefill", "decode"):
        import sys

        if not control_auth.signing_client_in_place(sys.modules.get(CONN)):
            gaps.append(f"bootstrap_auth -> {CONN}.requests (signing client)")
    if "side_channels" in RUNTIME.armed and role in ("prefill", "decode") and backend in backends.BACKEND_MODULES:
        import sys

        module = backends.BACKEND_MODULES[backend]
        if not zmq_listeners.listeners_restarting(sys.modules.get(module)):
            gaps.append(f"side_channels -> {module}.threading (listeners started again)")
    if gaps:
        raise HardenRefusal("sglang-harden: hooks missing in this process: " + "; ".join(gaps))


# ---------------------------------------------------------------- the table

# Releases whose prefill retires an aborted result itself (skipping the final send, never telling decode) have this
# target; the others do not need the hook.
RETIRED_RESULT_HOOKS = [
    Hook("abort_notify", PREFILL, "SchedulerDisaggregationPrefillMixin._retire_aborted_prefill_result",
         ("self", "req"), publish_retired_abort(READER), optional=True),
]


# The page lifecycle's and page tags' hooks: the common ones (SGLang's deferred release ending on the guard's drain
# evidence among them), then each transfer backend's.
LIFECYCLE_HOOKS: list[Hook] = [*lifecycle_v05.HOOKS, *deferred_release_v05.HOOKS, *backends.lifecycle_hooks()]

HOOKS: list[Hook] = [
    Hook("admission", *PREFILL_DOOR, ("self", "req", "num_kv_heads"),
         _door("prefill")),
    Hook("admission", *DECODE_DOOR, ("self", "req", "is_retracted"),
         _door("decode")),
    # Listed before retire, so its wrapper sits outside: a retired request is never digested.
    Hook("checksum", PREFILL, "SchedulerDisaggregationPrefillMixin.send_kv_chunk",
         ("self", "req", "last_chunk", "end_idx"), kv_digest.publish_sent_digest(DIGEST_READER)),
    *backends.receiver_hooks("canary", kv_canary.stamp_before_send),
    Hook("retire", PREFILL, "SchedulerDisaggregationPrefillMixin.send_kv_chunk",
         ("self", "req", "last_chunk", "end_idx"), _retire_final_send),
    Hook("coverage", UTILS, "MetadataBuffers.set_buf", ("self", "req"), _publish_coverage),
    # Decode's commit: one chain whose order is commit_chain's (ledger, coverage), not this list's; the checks that
    # read device memory wait at the commit gate before it (page tags, canary, checksum).
    commit_chain.hook("coverage", "coverage", _coverage_step),
    *commit_gate.hooks("canary", "canary", kv_canary.canary_step()),
    *commit_gate.hooks("checksum", "checksum", kv_digest.checksum_step(DIGEST_READER)),
    Hook("abort_notify", *SETUP_ROUTES, ("self",), abort_routes),
    Hook("checksum", *SETUP_ROUTES, ("self",), digest_routes),
    # Listed after abort_notify's routes, so the token check sits outside and sees every route.
    Hook("bootstrap_auth", *SETUP_ROUTES, ("self",), control_auth.require_tokens),
    Hook("abort_notify", CONN, "CommonKVReceiver.__init__", ("self", "mgr", "bootstrap_addr", "bootstrap_room"),
         watch_receiver),
    Hook("abort_notify", DECODE, "prepare_abort", ("req", "error_message", "status_code"), peer_status_abort),
    Hook("abort_notify", PREFILL, "SchedulerDisaggregationPrefillMixin.handle_bootstrap_failure", ("self", "req"),
         _publish_bootstrap_failure),
    Hook("abort_notify", CONN, "CommonKVManager.is_abort_release_safe", ("self", "bootstrap_room", "required_acks"),
         _release_when_never_written),
    *RETIRED_RESULT_HOOKS,
    # Listed before abort_notify's validation hook, so its wrapper sits outside and posts this refusal too.
    Hook("admission", TOKENIZER, "TokenizerManager._validate_one_request", ("self", "obj", "input_ids"),
         prefill_front_door),
    Hook("abort_notify", TOKENIZER, "TokenizerManager._validate_one_request", ("self", "obj", "input_ids"),
         validation_refusal),
    Hook("abort_notify", TOKENIZER, "TokenizerManager._tokenize_one_request", ("self", "obj"),
         tokenization_refusal),
    Hook("abort_notify", TOKENIZER, "TokenizerManager._dispatch_to_scheduler", ("self", "obj"),
         front_answers_refusals),
    Hook("startup", SCHEDULER, "Scheduler.__init__", ("self", "server_args", "port_args"), _scheduler_started),
    Hook("startup", SCHEDULER, "Scheduler.get_internal_state", ("self", "recv_req"),
         report_state(_family_report)),
    *LIFECYCLE_HOOKS,
    *page_tags_v05.HOOKS,
    *lifecycle_v05.ledger_hooks(LIFECYCLE_HOOKS),
    *zmq_channels.HOOKS,
]

# Which scheduler roles must have each owner's hooks in place ("null" = no disaggregation).
ROLES_BY_OWNER: dict[str, set[str]] = {
    "admission": {"prefill", "decode"},
    "retire": {"prefill"},
    "coverage": {"prefill", "decode"},
    "checksum": {"prefill", "decode"},
    "canary": {"decode"},
    "abort_notify": {"decode"},
    "startup": {"prefill", "decode", "null"},
    "bootstrap_auth": {"prefill", "decode"},
    "zmq_auth": {"prefill", "decode"},
    "side_channels": {"prefill", "decode"},
    **lifecycle_v05.ROLES,
}

MODULE_CALLBACKS: dict[str, Callable[[Any], None]] = {
    TOKENIZER: tokenizer_learns_limit,
    CONN: control_auth.install_signing_client,
    **{module: zmq_channels.listeners_restart for module in backends.BACKEND_MODULES.values()},
}

# Hooks whose targets only some releases of the family have (feature-probed at install); `compat sweep` probes every
# release for them.
OPTIONAL_HOOKS: list[Hook] = [h for h in HOOKS if h.optional]
