"""SGLang's deferred decode KV release, which the lifecycle guard switches on, ends on the guard's drain evidence.

Decode keeps a transfer that failed after decode published its pages (``DecodeTransferQueue._defer_release``: the
request's KV pages, its metadata slot) until ``CommonKVManager.is_abort_release_safe`` says every prefill rank
acknowledged the drain, or until ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT`` (30 s). On 0.5.19 and
0.5.20 (where the release is off by default: the guard turns it on) only ``Scheduler.abort_request`` arms SGLang's
ack tracker (``register_deferred_abort_room``); decode's own waiting timeout
(``CommonKVReceiver._check_waiting_timeout``) sends the abort notice without arming it, so ``note_abort_ack`` drops
prefill's acks and the room is held the full 30 s -- also when prefill never started a write for it and acked at
once. The next request that needs those pages waited 30 s (vanilla, release off: at once).

The lifecycle node counts the acks itself (``guards.drain_acks``: a live transfer of the room, its armed notice,
each targeted rank once), so the hold ends as soon as the guard's own rule says no write into the transfer's pages
can still land (:func:`sglang_harden.guards.lifecycle.writer_drained`: every targeted rank acked, prefill said it
never queued a write for the room, or its process is gone): the rule that already frees quarantined pages. Without
such evidence SGLang's answer stands; its timeout still ends the hold, and the pages then go to quarantine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang_harden import events
from sglang_harden.compat import lifecycle_v05
from sglang_harden.compat.hooks import Hook
from sglang_harden.compat.internals import CONN
from sglang_harden.compat.lifecycle_nodes import DecodeNode
from sglang_harden.compat.runtime import RUNTIME
from sglang_harden.config import Mode
from sglang_harden.guards import lifecycle
from sglang_harden.guards.base import Decision, Verdict

Func = Callable[..., Any]

REPORTED_MEMORY = 4096  # log mode: rooms whose early release was reported (once each, not on every scheduler loop)
_reported: dict[int, None] = {}


def drained_room(room: int) -> bool:
    """Whether the lifecycle node holds a live transfer of ``room`` whose writer drained by the guard's rule."""
    node = lifecycle_v05.NODE
    if not isinstance(node, DecodeNode):
        return False
    transfer = node.by_room.get(int(room))
    return transfer is not None and node.drained(transfer.owner)


def _release_on_drain_evidence(original: Func) -> Func:
    def is_abort_release_safe(self: Any, bootstrap_room: int, required_acks: int, *args: Any, **kwargs: Any) -> Any:
        if original(self, bootstrap_room, required_acks, *args, **kwargs):
            return True
        mode = RUNTIME.config.lifecycle
        room = int(bootstrap_room)
        if mode is Mode.OFF or not drained_room(room):
            return False
        if mode is not Mode.ENFORCE:
            if room in _reported:  # asked on every scheduler loop while held
                return False
            _reported[room] = None
            while len(_reported) > REPORTED_MEMORY:
                _reported.pop(next(iter(_reported)))
        decision = Decision(lifecycle.GUARD, Verdict.RELEASE, f"no write into room {room}'s pages can still land; "
                            "SGLang's deferred release ends now, not at its timeout", None, {"room": room})
        events.record(decision, mode)  # a release counts as allowing: applied by the mode, not by record's answer
        return mode is Mode.ENFORCE

    return is_abort_release_safe


HOOKS: list[Hook] = [
    Hook("lifecycle", CONN, "CommonKVManager.is_abort_release_safe", ("self", "bootstrap_room", "required_acks"),
         _release_on_drain_evidence),
]
