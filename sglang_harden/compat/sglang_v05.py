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
from sglang_harden.compat import lifecycle_v05, notify
from sglang_harden.compat.hooks import Hook, missing
from sglang_harden.compat.runtime import RUNTIME, HardenRefusal
from sglang_harden.config import CapacityMode
from sglang_harden.guards import admission, capacity, coverage, retire
from sglang_harden.guards.abort_notify import decide_on_peer_abort
from sglang_harden.guards.admission import AdmissionView, PendingRejection
from sglang_harden.guards.base import Decision, Verdict

logger = logging.getLogger("sglang_harden")

FAMILY = "sglang-0.5.19+"
PREFILL = "sglang.srt.disaggregation.prefill"
DECODE = "sglang.srt.disaggregation.decode"
UTILS = "sglang.srt.disaggregation.utils"
CONN = "sglang.srt.disaggregation.common.conn"
SCHEDULER = "sglang.srt.managers.scheduler"
TOKENIZER = "sglang.srt.managers.tokenizer_manager"
COVERAGE_SLOT = 15  # cached_tokens[idx][15]: spare in this family (slots 0-6 are used upstream)

Func = Callable[..., Any]


# ---------------------------------------------------------------- reading SGLang objects


def largest_accepted_prompt(scheduler: Any) -> int | None:
    """SGLang refuses ``len(prompt) >= max_req_input_len``, so the largest prompt it serves is one less."""
    limit = getattr(scheduler, "max_req_input_len", None)
    return None if limit is None else int(limit) - 1


def pending_rejection(req: Any) -> PendingRejection | None:
    """The abort SGLang already decided for ``req`` (``to_finish`` or ``finished_reason``), if any."""
    for attr in ("to_finish", "finished_reason"):
        reason = getattr(req, attr, None)
        if reason is not None and type(reason).__name__ == "FINISH_ABORT":
            status = getattr(reason, "status_code", None)
            return PendingRejection(str(reason.message), int(status or 400))
    return None


def role_of(scheduler: Any) -> str:
    mode = getattr(scheduler, "disaggregation_mode", None)
    return str(getattr(mode, "value", mode) or "null")


def _abort_and_stream(scheduler: Any, req: Any, message: str, status_code: int) -> None:
    from sglang.srt.disaggregation.utils import prepare_abort

    prepare_abort(req, message, status_code=status_code)
    if hasattr(req, "to_finish"):
        req.to_finish = None
    scheduler.output_streamer.stream_output([req], req.return_logprob)


def _publish_peer_abort(room: int | None, decision: Decision) -> None:
    if room is None or RUNTIME.publisher is None:
        return
    RUNTIME.publisher.publish(notify.PeerAbort(int(room), decision.status_code or 500, decision.reason))


# ---------------------------------------------------------------- admission (both doors)


def _door(role: str, get_scheduler: Callable[[Any], Any]) -> Callable[[Func], Func]:
    def make(original: Func) -> Func:
        def add(self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
            if role == "decode" and _is_retracted(args, kwargs):
                return original(self, req, *args, **kwargs)
            scheduler = get_scheduler(self)
            view = AdmissionView(
                rid=str(req.rid),
                role=role,
                prompt_len=len(req.origin_input_ids),
                pending=pending_rejection(req),
                limit=largest_accepted_prompt(scheduler),
            )
            decision = admission.decide_admission(view)
            if events.record(decision, RUNTIME.config.admission, room=req.bootstrap_room):
                _abort_and_stream(scheduler, req, decision.reason, decision.status_code or 400)
                if role == "prefill":
                    _publish_peer_abort(req.bootstrap_room, decision)
                return None
            return original(self, req, *args, **kwargs)

        return add

    return make


def _is_retracted(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """DecodePreallocQueue.add(req, is_retracted=False, ...): a retracted request re-enters with its own KV."""
    return bool(args[0]) if args else bool(kwargs.get("is_retracted", False))


# ---------------------------------------------------------------- retire (prefill final send)


def _retire_final_send(original: Func) -> Func:
    def send_kv_chunk(self: Any, req: Any, last_chunk: bool = False, end_idx: Any = None) -> Any:
        if last_chunk:
            view = retire.RetireView(str(req.rid), pending_rejection(req), _is_aborted(req))
            decision = retire.decide_final_send(view)
            if events.record(decision, RUNTIME.config.retire, room=req.bootstrap_room):
                sender = getattr(req, "disagg_kv_sender", None)
                if sender is not None:
                    sender.abort()
                _publish_peer_abort(req.bootstrap_room, decision)
                return None
        return original(self, req, last_chunk, end_idx)

    return send_kv_chunk


def _is_aborted(req: Any) -> bool:
    from sglang.srt.disaggregation.utils import is_aborted

    return bool(is_aborted(req))


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


def _bootstrap_routes(original: Func) -> Func:
    def setup_routes(self: Any) -> Any:
        result = original(self)
        self.app.router.add_put(notify.ABORT_PATH, _handle_abort_put)
        self.app.router.add_get(notify.ABORTS_PATH, _handle_aborts_get)
        return result

    return setup_routes


async def _handle_abort_put(request: Any) -> Any:
    from aiohttp import web

    try:
        abort = notify.parse_abort_body(await request.content.read(64 * 1024))
    except ValueError as exc:
        return web.json_response({"error": str(exc)}, status=400)
    notify.BOARD.post(abort)
    return web.json_response({"ok": True})


async def _handle_aborts_get(request: Any) -> Any:
    from aiohttp import web

    try:
        rooms = notify.parse_rooms_query(request.query.get("rooms", ""))
    except ValueError as exc:
        return web.json_response({"error": str(exc)}, status=400)
    return web.json_response(notify.aborts_payload(rooms))


def _watch_receiver(original: Func) -> Func:
    def init(self: Any, mgr: Any, bootstrap_addr: str, bootstrap_room: Any = None, *a: Any, **k: Any) -> Any:
        result = original(self, mgr, bootstrap_addr, bootstrap_room, *a, **k)
        watcher = RUNTIME.decode_watcher(_fail_receiver_room)
        if bootstrap_room is not None and watcher is not None:
            watcher.watch(bootstrap_addr, int(bootstrap_room), self)
        return result

    return init


def _fail_receiver_room(receiver: Any, abort: notify.PeerAbort) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    if getattr(receiver, "conclude_state", None) is not None:
        return
    decision = decide_on_peer_abort(str(abort.room), transfer_may_be_in_flight=False, writer_drained=True)
    if events.record(decision, RUNTIME.config.abort_notify, room=abort.room, peer_reason=abort.message):
        receiver.kv_mgr.record_failure(abort.room, abort.message)
        receiver.kv_mgr.update_status(abort.room, KVPoll.Failed)


def _peer_status_abort(original: Func) -> Func:
    """Decode's failure path aborts with 500; a room prefill rejected keeps prefill's own status and text."""

    def prepare_abort(req: Any, error_message: str, status_code: Any = None) -> Any:
        watcher = RUNTIME.watcher
        hit = watcher.hit(getattr(req, "bootstrap_room", None)) if watcher is not None else None
        if hit is not None:
            return original(req, hit.message, status_code=hit.status_code)
        return original(req, error_message, status_code=status_code)

    return prepare_abort


# ---------------------------------------------------------------- start-up: capacity gate, verification


def _scheduler_started(original: Func) -> Func:
    def init(self: Any, server_args: Any, port_args: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, server_args, port_args, *args, **kwargs)
        role = role_of(self)
        _verify_in_process(role)
        _capacity_gate(self)
        if role == "prefill":
            RUNTIME.start_publisher(_bootstrap_base_url(self))
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


def _bootstrap_base_url(scheduler: Any) -> str:
    host = scheduler.server_args.host
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://{host}:{scheduler.disagg_prefill_bootstrap_queue.bootstrap_port}"


def _capacity_gate(scheduler: Any) -> None:
    mode: CapacityMode = RUNTIME.config.capacity
    context_len = int(scheduler.model_config.context_len)
    decision = capacity.decide_capacity(
        context_len, int(scheduler.max_req_input_len), capacity.SGLANG_MARGIN, mode
    )
    if not events.record(decision, capacity.record_mode(mode), role=role_of(scheduler)):
        return
    if decision.verdict is Verdict.CLAMP:
        scheduler.model_config.context_len = int(decision.fields["context_len"])
        return
    raise HardenRefusal("sglang-harden capacity gate: " + decision.reason)


def _tokenizer_learns_limit(module: Any) -> None:
    """Clamp mode: when the main process learns the pool-derived limit, it lowers its advertised context."""
    cls = module.TokenizerManager

    def get(self: Any) -> Any:
        return self.__dict__.get("_harden_max_req_input_len")

    def set_(self: Any, value: Any) -> None:
        self.__dict__["_harden_max_req_input_len"] = value
        if value is None or RUNTIME.config.capacity is not CapacityMode.CLAMP:
            return
        fitting = capacity.largest_fitting_context(int(value))
        if fitting < self.model_config.context_len:
            logger.warning("sglang-harden: clamping advertised context %s -> %s", self.context_len, fitting)
            self.model_config.context_len = fitting
            self.context_len = fitting

    cls.max_req_input_len = property(get, set_)


def _verify_in_process(role: str) -> None:
    from sglang_harden.compat.hooks import registered_hooks

    needed = [h for h in registered_hooks() if role in ROLES_BY_OWNER.get(h.owner, {role})]
    gaps = missing(needed)
    if gaps:
        raise HardenRefusal("sglang-harden: hooks missing in this process: " + "; ".join(gaps))


# ---------------------------------------------------------------- the table


def _prefill_scheduler(queue: Any) -> Any:
    return queue.scheduler


def _decode_scheduler(queue: Any) -> Any:
    return queue.scheduler


HOOKS: list[Hook] = [
    Hook("admission", PREFILL, "PrefillBootstrapQueue.add", ("self", "req", "num_kv_heads"),
         _door("prefill", _prefill_scheduler)),
    Hook("admission", DECODE, "DecodePreallocQueue.add", ("self", "req", "is_retracted"),
         _door("decode", _decode_scheduler)),
    Hook("retire", PREFILL, "SchedulerDisaggregationPrefillMixin.send_kv_chunk",
         ("self", "req", "last_chunk", "end_idx"), _retire_final_send),
    Hook("coverage", UTILS, "MetadataBuffers.set_buf", ("self", "req"), _publish_coverage),
    Hook("coverage", DECODE, "DecodeTransferQueue._commit_transfer_to_req", ("self", "decode_req"),
         _check_coverage),
    Hook("abort_notify", CONN, "CommonKVBootstrapServer._setup_routes", ("self",), _bootstrap_routes),
    Hook("abort_notify", CONN, "CommonKVReceiver.__init__", ("self", "mgr", "bootstrap_addr", "bootstrap_room"),
         _watch_receiver),
    Hook("abort_notify", DECODE, "prepare_abort", ("req", "error_message", "status_code"), _peer_status_abort),
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

MODULE_CALLBACKS: dict[str, Callable[[Any], None]] = {TOKENIZER: _tokenizer_learns_limit}
