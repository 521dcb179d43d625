"""Hook bodies that read the same on every supported SGLang family.

They touch SGLang only through the objects SGLang passes in and names that did not move between 0.4.9 and
0.5.23 (``KVPoll``, the bootstrap server's aiohttp ``app``, ``model_config.context_len``, ``max_req_input_len``,
``TokenizerManager``); each family module lists them in its own hook table.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sglang_harden import events
from sglang_harden.channels import abort_wire
from sglang_harden.compat import digest_channel, notify
from sglang_harden.compat.runtime import RUNTIME, HardenRefusal
from sglang_harden.config import CapacityMode, Mode
from sglang_harden.guards import admission, capacity, retire
from sglang_harden.guards.abort_notify import (
    decide_on_front_answer,
    decide_on_front_door_refusal,
    decide_on_peer_abort,
    decide_on_prefill_abort,
)
from sglang_harden.guards.admission import AdmissionView, PendingRejection
from sglang_harden.guards.base import Decision, Verdict

logger = logging.getLogger("sglang_harden")

Func = Callable[..., Any]
TOKENIZER = "sglang.srt.managers.tokenizer_manager"


def in_scheduler(hook: Any) -> bool:
    """Tokenizer-manager hooks live in the main process (a missing target fails its import there, closed)."""
    return hook.module != TOKENIZER


def largest_accepted_prompt(scheduler: Any) -> int | None:
    """The longest prompt this node's pool holds: ``max_req_input_len`` (SGLang's own check refuses one token
    earlier, ``len >= max_req_input_len``, but serves exactly that many after ``--allow-auto-truncate``)."""
    limit = getattr(scheduler, "max_req_input_len", None)
    return None if limit is None else int(limit)


@dataclass(frozen=True)
class RequestReader:
    """How one family reads and ends a ``Req``: the only per-family part of the door and retire hooks."""

    pending_rejection: Callable[[Any], PendingRejection | None]
    is_aborted: Callable[[Any], bool]
    abort_and_stream: Callable[[Any, Any, str, int], None]


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


def abort_routes(original: Func) -> Func:
    """``<BootstrapServer>._setup_routes``: the abort board (abort_notify's). On a tree whose backport series
    already serves ``/pd_rejections`` (same wire format), the patched routes stay and ours are not added."""
    return _with_routes(original, lambda: [("PUT", notify.ROUTE, handle_abort_put),
                                           ("GET", notify.ROUTE, handle_aborts_get)])


def digest_routes(original: Func) -> Func:
    """``<BootstrapServer>._setup_routes``: the digest board and feed (checksum's: decode reads a 404 there as
    "prefill is not hardened", so they must exist whenever the checksum guard is on, whatever abort_notify is)."""
    return _with_routes(original, lambda: [("PUT", digest_channel.DIGEST_PATH, handle_digest_put),
                                           ("GET", digest_channel.DIGESTS_PATH, handle_digests_get),
                                           ("GET", digest_channel.FEED_PATH, handle_digest_feed_get)])


def _with_routes(original: Func, routes: Callable[[], list[tuple[str, str, Any]]]) -> Func:
    def setup_routes(self: Any) -> Any:
        result = original(self)
        taken = _routes_served(self.app)
        for method, path, handler in routes():
            if (method, path) not in taken:
                self.app.router.add_route(method, path, handler)
        return result

    return setup_routes


def _routes_served(app: Any) -> set[tuple[str, str]]:
    served = set()
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        served.add((route.method, info.get("path") or info.get("formatter") or ""))
    return served


async def handle_abort_put(request: Any) -> Any:
    """Only the prefill node's own processes post aborts (same host); anyone else gets 403."""
    return await _accept_from_this_host(request, "aborts", abort_wire.MAX_NOTICE_BYTES,
                                        notify.parse_abort_body, notify.BOARD.post)


def _from_this_host(request: Any) -> bool:
    sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
    return notify.is_same_host(request.remote, sockname[0] if sockname else None)


async def handle_digest_put(request: Any) -> Any:
    """Only the prefill node's own schedulers post digests (same host); anyone else gets 403."""
    return await _accept_from_this_host(request, "digests", 256 * 1024, digest_channel.parse_digest_body,
                                        digest_channel.post_and_signal)


async def _accept_from_this_host(request: Any, what: str, limit: int, parse: Callable[[bytes], Any],
                                 post: Callable[[Any], None]) -> Any:
    """A side-channel PUT: 403 from another host, 413 over ``limit`` bytes, 400 on a malformed body, else
    ``post(parse(body))``. The body is read whole (aiohttp caps it at the app's client_max_size, 1 MiB by default)
    because the control-plane token check may have read it already."""
    from aiohttp import web

    if not _from_this_host(request):
        return web.json_response({"error": f"{what} are accepted from this host only"}, status=403)
    body = await request.read()
    if len(body) > limit:
        return web.json_response({"error": f"{what}: body over {limit} bytes"}, status=413)
    try:
        item = parse(body)
    except ValueError as exc:
        return web.json_response({"error": str(exc)}, status=400)
    post(item)
    return web.json_response({"ok": True})


async def handle_digests_get(request: Any) -> Any:
    from aiohttp import web

    try:
        room = int(request.query.get("room", ""))
    except ValueError:
        return web.json_response({"error": "room must be an integer"}, status=400)
    publishing = RUNTIME.config.checksum is not Mode.OFF
    return web.json_response(digest_channel.digests_payload(room, publishing))


async def handle_digest_feed_get(request: Any) -> Any:
    """Decode's feed reader: every digest posted after its cursor, answered as soon as there is one."""
    from aiohttp import web

    try:
        ask = digest_channel.parse_feed_query(dict(request.query))
    except ValueError as exc:
        return web.json_response({"error": str(exc)}, status=400)
    if not digest_channel.feed_has_news(ask) and ask.wait_s > 0:
        await digest_channel.POSTED.wait(ask.wait_s)
    publishing = RUNTIME.config.checksum is not Mode.OFF
    return web.json_response(digest_channel.feed_payload(ask, publishing))


async def handle_aborts_get(request: Any) -> Any:
    from aiohttp import web

    try:
        rooms = notify.parse_rooms_query(request.query.get("rooms", ""))
    except ValueError as exc:
        return web.json_response({"error": str(exc)}, status=400)
    return web.json_response(notify.aborts_payload(rooms))


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


def prefill_front_door(original: Func) -> Func:
    """``TokenizerManager._validate_one_request`` on a PD prefill: a prompt the scheduler is certain to refuse as too
    long for the pool is refused here, before it queues for a scheduler loop (the abort-notify wrapper outside
    posts the refusal on the abort board, so decode answers its half too)."""

    def validate(self: Any, obj: Any, input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, obj, input_ids, *args, **kwargs)
        if not _is_prefill_front(self):
            return result
        limit = self.max_req_input_len
        view = admission.FrontView(
            rid=str(getattr(obj, "rid", None)),
            prompt_len=None if input_ids is None else len(input_ids),
            limit=None if limit is None else int(limit),
            truncates=bool(getattr(self.server_args, "allow_auto_truncate", False)),
        )
        decision = admission.decide_at_front(view)
        if events.record(decision, RUNTIME.config.admission, room=getattr(obj, "bootstrap_room", None)):
            raise ValueError(decision.reason)
        return result

    return validate


def validation_refusal(original: Func) -> Func:
    """``TokenizerManager._validate_one_request``: a refusal on prefill's front door reaches decode too."""

    def validate(self: Any, obj: Any, input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, obj, input_ids, *args, **kwargs)
        except ValueError as exc:
            publish_front_door_refusal(self, obj, exc)
            raise

    return validate


def tokenization_refusal(original: Func) -> Func:
    """``TokenizerManager._tokenize_one_request``: the same for refusals raised while tokenizing."""

    async def tokenize(self: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await original(self, obj, *args, **kwargs)
        except ValueError as exc:
            publish_front_door_refusal(self, obj, exc)
            raise

    return tokenize


def publish_front_door_refusal(tokenizer_manager: Any, obj: Any, exc: ValueError) -> None:
    """Post the refusal on this node's abort board (served by the bootstrap server in this very process)."""
    if getattr(exc, "_sglang_harden_published", False) or not _is_prefill_front(tokenizer_manager):
        return
    room = getattr(obj, "bootstrap_room", None)
    room = room if isinstance(room, int) and not isinstance(room, bool) else None
    decision = decide_on_front_door_refusal(str(getattr(obj, "rid", None)), room, str(exc))
    if events.record(decision, RUNTIME.config.abort_notify, role="prefill") and room is not None:
        notify.BOARD.post(notify.PeerAbort(room, decision.status_code or 400, str(exc), sent_kv=False))
    try:
        exc._sglang_harden_published = True  # type: ignore[attr-defined]
    except AttributeError:
        pass


def _is_prefill_front(tokenizer_manager: Any) -> bool:
    return _front_role(tokenizer_manager) == "prefill"


def _front_role(tokenizer_manager: Any) -> str:
    mode = getattr(getattr(tokenizer_manager, "server_args", None), "disaggregation_mode", None)
    return str(getattr(mode, "value", mode))


# ---------------------------------------------------------------- decode's front answers prefill's refusals


@dataclass(eq=False)
class FrontWait:
    """A client waiting on decode's HTTP server for a PD request: where to answer it if prefill refuses."""

    tokenizer_manager: Any
    loop: asyncio.AbstractEventLoop
    rid: str
    state: weakref.ref[Any]


# keeps each FrontWait alive as long as its request state (the watcher holds weak references only)
_FRONT_WAITS: dict[int, FrontWait] = {}


def front_answers_refusals(original: Func) -> Func:
    """``TokenizerManager._dispatch_to_scheduler`` on decode: every PD request handed to the scheduler is also
    watched on its prefill's abort board from this process, so a refusal there reaches the client at once,
    however long decode's scheduler takes per loop."""

    def dispatch(self: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, obj, *args, **kwargs)
        if _front_role(self) == "decode":
            batch = getattr(obj, "batch", None)
            for one in batch if isinstance(batch, list) else [obj]:
                _watch_at_front(self, one)
        return result

    return dispatch


def _watch_at_front(tokenizer_manager: Any, obj: Any) -> None:
    rid, room = getattr(obj, "rid", None), getattr(obj, "bootstrap_room", None)
    host, port = getattr(obj, "bootstrap_host", None), getattr(obj, "bootstrap_port", None)
    if not isinstance(rid, str) or not isinstance(room, int) or isinstance(room, bool) or not host or not port:
        return
    state = getattr(tokenizer_manager, "rid_to_state", {}).get(rid)
    if state is None:
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    watcher = RUNTIME.front_watcher(_answer_at_front, _front_concluded)
    if watcher is None:
        return
    wait = FrontWait(tokenizer_manager, loop, rid, weakref.ref(state))
    _FRONT_WAITS[id(state)] = wait
    weakref.finalize(state, _FRONT_WAITS.pop, id(state), None)
    watcher.watch(f"{host}:{port}", room, wait)


def _front_concluded(wait: object) -> bool:
    state = wait.state() if isinstance(wait, FrontWait) else None
    return state is None or bool(getattr(state, "finished", True))


def _answer_at_front(wait: object, abort: notify.PeerAbort) -> None:
    """Watcher thread: hand the answer to the tokenizer's event loop (request states belong to it)."""
    if not isinstance(wait, FrontWait):
        return
    try:
        wait.loop.call_soon_threadsafe(finish_at_front, wait, abort)
    except RuntimeError:  # the loop is closed: the server is going down
        pass


def finish_at_front(wait: FrontWait, abort: notify.PeerAbort) -> None:
    """Event loop: end the waiting request with prefill's status and message, as SGLang ends an aborted one
    (its state leaves ``rid_to_state``; the scheduler's later output for the rid is dropped)."""
    state, manager = wait.state(), wait.tokenizer_manager
    if state is None or state.finished or manager.rid_to_state.get(wait.rid) is not state:
        return
    decision = decide_on_front_answer(wait.rid, abort.room, abort.status_code, abort.message)
    if not events.record(decision, RUNTIME.config.abort_notify, role="decode", room=abort.room):
        return
    del manager.rid_to_state[wait.rid]
    state.out_list.append(_aborted_output(wait.rid, state, abort))
    state.finished = True
    state.event.set()


def _aborted_output(rid: str, state: Any, abort: notify.PeerAbort) -> dict[str, Any]:
    prompt = getattr(getattr(state, "obj", None), "input_ids", None)
    finish = {"type": "abort", "message": abort.message, "status_code": abort.status_code}
    meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(prompt) if isinstance(prompt, list) else 0,
            "completion_tokens": 0, "cached_tokens": 0}
    return {"text": "", "output_ids": [], "meta_info": meta}


def peer_status_abort(original: Func) -> Func:
    """Decode's failure path aborts with 500; a room prefill rejected keeps prefill's own status and text."""

    def prepare_abort(req: Any, error_message: str, status_code: Any = None) -> Any:
        watcher = RUNTIME.watcher
        hit = watcher.hit(getattr(req, "bootstrap_room", None)) if watcher is not None else None
        if hit is not None:
            return original(req, hit.message, status_code=hit.status_code)
        return original(req, error_message, status_code=status_code)

    return prepare_abort


def bootstrap_base_url(scheduler: Any) -> str:
    host = scheduler.server_args.host
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://{host}:{scheduler.disagg_prefill_bootstrap_queue.bootstrap_port}"


def capacity_gate(scheduler: Any) -> None:
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
        "pin": RUNTIME.pin,
        "family": RUNTIME.family,
        "role": role_of(scheduler),
        "guards": list(RUNTIME.armed),
        "max_total_num_tokens": int(scheduler.max_total_num_tokens),
        "available_tokens": int(allocator.available_size()),
        "evictable_tokens": int(evictable),
        "max_req_input_len": int(scheduler.max_req_input_len),
        "context_len": int(scheduler.model_config.context_len),
        "control_plane_auth": _control_plane_status(),
        "decisions": events.snapshot(),
    }


def _control_plane_status() -> str:
    from sglang_harden.compat import control_auth  # imported late: a leaf of the family modules

    return control_auth.status()
