"""The plugin's commit gate (the rule: :mod:`.gate`): hooks on every backend receiver's ``poll`` and the transfer
queue's ``pop_transferred`` (which requests are in the queue), installed by the first step that joins, like
:mod:`.commit_chain`; decisions are recorded through :mod:`sglang_harden.events` in each guard's mode.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sglang_harden import events
from sglang_harden.compat import commit_chain
from sglang_harden.compat.backends import receiver_poll_hooks
from sglang_harden.compat.gate import CommitGate, GateWiring, Step, refusal_message
from sglang_harden.compat.hooks import Hook
from sglang_harden.compat.internals import POP_TRANSFERRED
from sglang_harden.compat.runtime import RUNTIME
from sglang_harden.guards.base import Decision, Verdict

logger = logging.getLogger("sglang_harden")

Func = Callable[..., Any]
GATE_MARK = "__sglang_harden_commit_gate__"
_TALLIES: dict[int, events.Tally] = {}  # id of a constant ALLOW decision -> its tally (the hot path's count)


def count_allows(tally: events.Tally) -> None:
    """A step's constant ALLOW decision is counted by ``tally`` (a bump, not a full record)."""
    _TALLIES[id(tally.decision)] = tally


def _record(decision: Decision, guard: str, room: Any, rid: Any) -> bool:
    mode = RUNTIME.config.mode(guard)
    tally = _TALLIES.get(id(decision))
    if tally is not None and tally.decision is decision:
        tally.bump(mode, room=room, rid=rid)
        return False
    return events.record(decision, mode, room=room, rid=rid)


def _is_fake_transfer(req: Any) -> bool:
    """SGLang's own warm-up pairs decode with an in-process fake transfer that sends no KV at all."""
    from sglang.srt.disaggregation.utils import _is_fake_transfer as is_fake

    return bool(is_fake(req))


def wiring() -> GateWiring:
    """SGLang's poll states (imported on first use) and the plugin's recording."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    return GateWiring(KVPoll.Success, KVPoll.Transferring, KVPoll.Failed, _is_fake_transfer, _record)


GATE = CommitGate()


# ---------------------------------------------------------------- hooks


def _see_queue(gate: CommitGate) -> Callable[[Func], Func]:
    def make(original: Func) -> Func:
        if getattr(original, GATE_MARK, False):
            return original

        def pop_transferred(self: Any, *args: Any, **kwargs: Any) -> Any:
            gate.see_queue(self)
            return original(self, *args, **kwargs)

        setattr(pop_transferred, GATE_MARK, True)
        return pop_transferred

    make.times_itself = True  # type: ignore[attr-defined]
    return make


def _gate_poll(gate: CommitGate) -> Callable[[Func], Func]:
    def make(original: Func) -> Func:
        if getattr(original, GATE_MARK, False):
            return original

        def poll(self: Any, *args: Any, **kwargs: Any) -> Any:
            return gate.gate(self, original(self, *args, **kwargs))

        setattr(poll, GATE_MARK, True)
        return poll

    make.times_itself = True  # type: ignore[attr-defined]
    return make


def _judged_at_commit(queue: Any, decode_req: Any, _context: dict[str, Any]) -> bool:
    """Commit-chain step: a transfer that did not pass the gate is judged now (waiting; logged, it should not
    happen on the poll paths the gate sees) and aborted if a step refuses it."""
    room = getattr(decode_req.req, "bootstrap_room", None)
    if GATE.wiring is None or room is None:
        return False
    if int(room) not in GATE.passed and GATE.steps and not _is_fake_transfer(decode_req.req):
        logger.warning("sglang-harden commit gate: room %s reached the commit without passing the gate; judging it "
                       "now (a host synchronisation)", room)
    try:
        refused = GATE.judge_at_commit(queue, decode_req)
    except TimeoutError as exc:
        refused = ("commit gate", Decision("commit_gate", Verdict.ABORT, str(exc), 500))
    if refused is None:
        return False
    from sglang.srt.disaggregation.utils import prepare_abort

    guard, decision = refused
    prepare_abort(decode_req.req, refusal_message(guard, decision), status_code=decision.status_code or 500)
    decode_req.kv_receiver.clear()
    decode_req.kv_receiver = None
    return True


def hooks(owner: str, name: str, step: Step, gate: CommitGate = GATE) -> list[Hook]:
    """``owner``'s hooks for its gate ``step``: the step joins the gate when the first of them is installed; the
    commit chain's last step judges a transfer that did not pass it."""

    def joined(make: Callable[[Func], Func]) -> Callable[[Func], Func]:
        def install(original: Func) -> Func:
            if gate.wiring is None:
                gate.wire(wiring())
            gate.join(name, step, owner)
            return make(original)

        install.times_itself = True  # type: ignore[attr-defined]
        return install

    return [*receiver_poll_hooks(owner, joined(_gate_poll(gate))),
            Hook(owner, *POP_TRANSFERRED, ("self",), joined(_see_queue(gate))),
            commit_chain.hook(owner, "gate", _judged_at_commit)]
