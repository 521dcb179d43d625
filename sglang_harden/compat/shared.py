"""Hook bodies that read the same on every supported SGLang family.

They touch SGLang only through the objects SGLang passes in and names that did not move between 0.4.9 and
0.5.23 (``KVPoll``, the bootstrap server's aiohttp ``app``, ``model_config.context_len``, ``max_req_input_len``,
``TokenizerManager``); each family module lists them in its own hook table. The bootstrap server's routes are
in :mod:`.bootstrap_routes`, the ``TokenizerManager`` front-door hooks in :mod:`.front_hooks`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sglang_harden import __version__, events
from sglang_harden.compat import notify

# the bootstrap-server routes and the TokenizerManager front hooks live in their own modules; the family adapters
# import them from here with the rest of the shared hook bodies
from sglang_harden.compat.bootstrap_routes import abort_routes, digest_routes  # noqa: F401
from sglang_harden.compat.front_hooks import (  # noqa: F401
    front_answers_refusals,
    prefill_front_door,
    tokenization_refusal,
    validation_refusal,
)
from sglang_harden.compat.internals import TOKENIZER  # noqa: F401 - the family tables import it from here
from sglang_harden.compat.runtime import RUNTIME, HardenRefusal
from sglang_harden.compat.side_routes import bootstrap_base_url  # noqa: F401 - the families import it from here
from sglang_harden.config import CapacityMode
from sglang_harden.guards import admission, capacity, retire
from sglang_harden.guards.abort_notify import decide_on_peer_abort, decide_on_prefill_abort
from sglang_harden.guards.admission import AdmissionView, PendingRejection
from sglang_harden.guards.base import Decision, Verdict

logger = logging.getLogger("sglang_harden")

Func = Callable[..., Any]


def in_scheduler(hook: Any) -> bool:
    """Tokenizer-manager hooks live in the main process (a missing target fails its import there, closed)."""
    return hook.module != TOKENIZER


def largest_accepted_prompt(scheduler: Any) -> int | None:
    """The longest prompt this node's pool holds: ``max_req_input_len`` (SGLang's own check refuses one token
    earlier, ``len >= max_req_input_len``, but serves exactly that many after ``--allow-auto-truncate``)."""
    limit = getattr(scheduler, "max_req_input_len", None)
    return None if limit is None else int(limit)


def largest_servable_prompt_of(queue: Any, role: str) -> int | None:
    """The longest prompt this node's pool admits when idle (None: pool, page size or decode's reserve unknown)."""
    scheduler = queue.scheduler
    pool = getattr(scheduler, "max_total_num_tokens", None)
    page = getattr(scheduler, "page_size", None)
    reserved = getattr(queue, "num_reserved_decode_tokens", None) if role == "decode" else 0
    if pool is None or page is None or reserved is None:
        return None
    return capacity.largest_servable_prompt(role, int(pool), int(page), int(reserved))


@dataclass(frozen=True)
class RequestReader:
    """How one family reads and ends a ``Req``: the only per-family part of the door and retire hooks."""

    pending_rejection: Callable[[Any], PendingRejection | None]
    is_aborted: Callable[[Any], bool]
    abort_and_stream: Callable[[Any, Any, str, int], None]


def pending_rejection(req: Any) -> PendingRejection | None:
    """The abort SGLang already decided for ``req``: in ``to_finish`` (0.5.4.post2 on) or ``finished_reason``."""
    for attr in ("to_finish", "finished_reason"):
        reason = getattr(req, attr, None)
        if reason is not None and type(reason).__name__ == "FINISH_ABORT":
            status = getattr(reason, "status_code", None)
            return PendingRejection(str(reason.message), int(status or 400))
    return None


def room_of(req: Any) -> int | None:
    room = getattr(req, "bootstrap_room", None)
    return None if room is None else int(room)


def publish_peer_abort(room: int | None, decision: Decision, *, sent_kv: bool) -> None:
    if room is None or RUNTIME.publisher is None:
        return
    RUNTIME.publisher.publish(notify.PeerAbort(room, decision.status_code or 500, decision.reason, sent_kv))


def door(role: str, reader: RequestReader) -> Callable[[Func], Func]:
    """``PrefillBootstrapQueue.add(req, …)`` / ``DecodePreallocQueue.add(req, is_retracted, …)``: the
    admission decision before any bootstrap, allocation or transfer; prefill tells decode what it refused."""

    def make(original: Func) -> Func:
        def add(self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
            if role == "decode" and is_retracted(args, kwargs):
                return original(self, req, *args, **kwargs)
            scheduler = self.scheduler
            view = AdmissionView(
                rid=str(req.rid),
                role=role,
                prompt_len=len(req.origin_input_ids),
                pending=reader.pending_rejection(req),
                limit=largest_accepted_prompt(scheduler),
                servable=largest_servable_prompt_of(self, role),
            )
            decision = admission.decide_admission(view)
            if events.record(decision, RUNTIME.config.admission, room=room_of(req)):
                reader.abort_and_stream(scheduler, req, decision.reason, decision.status_code or 400)
                if role == "prefill":
                    publish_peer_abort(room_of(req), decision, sent_kv=False)
                return None
            return original(self, req, *args, **kwargs)

        return add

    return make


def is_retracted(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A retracted request re-enters decode's door with its own KV (offloaded, not transferred)."""
    return bool(args[0]) if args else bool(kwargs.get("is_retracted", False))


def retire_final_send(reader: RequestReader) -> Callable[[Func], Func]:
    """``send_kv_chunk(req, last_chunk, end_idx)``: an aborted or rejected request never sends its final
    chunk; its sender is failed and decode is told (earlier chunks may have gone: ``sent_kv``)."""

    def make(original: Func) -> Func:
        def send_kv_chunk(self: Any, req: Any, last_chunk: bool = False, end_idx: Any = None) -> Any:
            if last_chunk:
                view = retire.RetireView(str(req.rid), reader.pending_rejection(req), reader.is_aborted(req))
                decision = retire.decide_final_send(view)
                if events.record(decision, RUNTIME.config.retire, room=room_of(req)):
                    sender = getattr(req, "disagg_kv_sender", None)
                    if sender is not None:
                        sender.abort()
                    publish_peer_abort(room_of(req), decision, sent_kv=True)
                    return None
            return original(self, req, last_chunk, end_idx)

        return send_kv_chunk

    return make


def publish_retired_abort(reader: RequestReader) -> Callable[[Func], Func]:
    """``_retire_aborted_prefill_result(req) -> bool`` (0.5.20+): upstream retires an aborted prefill result
    itself (no final send) but never tells decode; once it did, publish the abort for decode."""

    def make(original: Func) -> Func:
        def retire_result(self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
            retired = original(self, req, *args, **kwargs)
            if retired:
                pending = reader.pending_rejection(req)
                message = pending.message if pending else "aborted"
                decision = decide_on_prefill_abort(str(req.rid), room_of(req), message,
                                                   pending.status_code if pending else None)
                if events.record(decision, RUNTIME.config.abort_notify, role="prefill"):
                    publish_peer_abort(room_of(req), decision, sent_kv=True)
            return retired

        return retire_result

    return make


def role_of(scheduler: Any) -> str:
    mode = getattr(scheduler, "disaggregation_mode", None)
    return str(getattr(mode, "value", mode) or "null")


def watch_receiver(original: Func) -> Func:
    def init(self: Any, mgr: Any, bootstrap_addr: str, bootstrap_room: Any = None, *a: Any, **k: Any) -> Any:
        result = original(self, mgr, bootstrap_addr, bootstrap_room, *a, **k)
        watcher = RUNTIME.decode_watcher(fail_receiver_room)
        if bootstrap_room is not None and watcher is not None:
            watcher.watch(bootstrap_addr, int(bootstrap_room), self)
        feed = RUNTIME.digest_feed()
        if bootstrap_room is not None and feed is not None:
            feed.watch(bootstrap_addr, int(bootstrap_room), self)
        return result

    return init


def fail_receiver_room(receiver: Any, abort: notify.PeerAbort) -> None:
    from sglang.srt.disaggregation.base.conn import KVPoll

    never_started = RUNTIME.writer_never_started
    if not abort.sent_kv and never_started is not None:  # a fact from prefill, whatever decode does next
        never_started(int(abort.room), str(getattr(receiver, "bootstrap_addr", "")))
    if getattr(receiver, "conclude_state", None) is not None:
        return
    decision = decide_on_peer_abort(str(abort.room), transfer_may_be_in_flight=abort.sent_kv, writer_drained=False)
    if events.record(decision, RUNTIME.config.abort_notify, room=abort.room, peer_reason=abort.message):
        receiver.kv_mgr.record_failure(abort.room, abort.message)
        receiver.kv_mgr.update_status(abort.room, KVPoll.Failed)
        # concluded, as SGLang's own receivers do on a local failure: up to 0.5.22 decode polls its
        # preallocation queue only while some entry there is mid-handshake or concluded failed
        receiver.conclude_state = KVPoll.Failed


def peer_status_abort(original: Func) -> Func:
    """Decode's failure path aborts with 500; a room prefill rejected keeps prefill's own status and text."""

    def prepare_abort(req: Any, error_message: str, status_code: Any = None) -> Any:
        watcher = RUNTIME.watcher
        hit = watcher.hit(getattr(req, "bootstrap_room", None)) if watcher is not None else None
        if hit is not None:
            return original(req, hit.message, status_code=hit.status_code)
        return original(req, error_message, status_code=status_code)

    return prepare_abort


def capacity_gate(scheduler: Any) -> None:
    mode: CapacityMode = RUNTIME.config.capacity
    context_len = int(scheduler.model_config.context_len)
    decision = capacity.decide_capacity(
        context_len, int(scheduler.max_req_input_len), capacity.SGLANG_MARGIN, mode
    )
    warn_unservable_limit(scheduler, mode)
    if not events.record(decision, capacity.record_mode(mode), role=role_of(scheduler)):
        return
    if decision.verdict is Verdict.CLAMP:
        scheduler.model_config.context_len = int(decision.fields["context_len"])
        return
    raise HardenRefusal("sglang-harden capacity gate: " + decision.reason)


def warn_unservable_limit(scheduler: Any, mode: CapacityMode) -> None:
    """Start-up warning, counted: the pool cannot serve every prompt the node advertises (the doors refuse those)."""
    role = role_of(scheduler)
    queue = getattr(scheduler, "disagg_decode_prealloc_queue" if role == "decode" else "disagg_prefill_bootstrap_queue",
                    None)
    if role not in ("prefill", "decode") or queue is None:
        return
    servable = largest_servable_prompt_of(queue, role)
    if servable is None:
        return
    decision = capacity.decide_servable(role, servable, int(scheduler.max_req_input_len), mode)
    events.record(decision, capacity.record_mode(CapacityMode.OFF if mode is CapacityMode.OFF else CapacityMode.LOG),
                  role=role)


def tokenizer_learns_limit(module: Any) -> None:
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


def report_state(extra: Callable[[], dict[str, Any]] = dict) -> Callable[[Func], Func]:
    """``Scheduler.get_internal_state``: ``/server_info`` gains ``internal_states[i].sglang_harden`` (pin, armed
    guards, pool occupancy, decision counts, and what the family adds)."""

    def make(original: Func) -> Func:
        def get_internal_state(self: Any, recv_req: Any) -> Any:
            output = original(self, recv_req)
            state = getattr(output, "internal_state", None)
            if isinstance(state, dict):
                state["sglang_harden"] = {**pool_report(self), **extra()}
            return output

        return get_internal_state

    return make


def pool_report(scheduler: Any) -> dict[str, Any]:
    allocator = scheduler.token_to_kv_pool_allocator
    evictable = scheduler.tree_cache.evictable_size() if scheduler.tree_cache is not None else 0
    return {
        "version": __version__,
        "pin": RUNTIME.pin,
        "family": RUNTIME.family,
        "mode": RUNTIME.mode_summary(),
        "role": role_of(scheduler),
        "guards": list(RUNTIME.armed),
        "max_total_num_tokens": int(scheduler.max_total_num_tokens),
        "available_tokens": int(allocator.available_size()),
        "evictable_tokens": int(evictable),
        "max_req_input_len": int(scheduler.max_req_input_len),
        "context_len": int(scheduler.model_config.context_len),
        "control_plane_auth": _control_plane_status(),
        "side_channel_auth": _side_channel_status(),
        "model_shape": RUNTIME.model_shape,
        "decisions": events.snapshot(),
    }


def _control_plane_status() -> str:
    from sglang_harden.compat import control_auth  # imported late: a leaf of the family modules

    return control_auth.status()


def _side_channel_status() -> str:
    from sglang_harden.compat import zmq_settings  # imported late: a leaf of the family modules

    return zmq_settings.status()
