"""``TokenizerManager`` hooks on a PD front door, shared by the 0.5.x and 0.4.9 family adapters.

On prefill: a prompt the scheduler is certain to refuse is refused before it queues, and every refusal raised
while validating or tokenizing is posted on the abort board so decode answers its half too. On decode: each
request handed to the scheduler is watched on its prefill's abort board, so prefill's refusal reaches the client
at once (:func:`front_answers_refusals`).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sglang_harden import events
from sglang_harden.compat import notify
from sglang_harden.compat.runtime import RUNTIME
from sglang_harden.guards import admission
from sglang_harden.guards.abort_notify import decide_on_front_answer, decide_on_front_door_refusal

Func = Callable[..., Any]


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
