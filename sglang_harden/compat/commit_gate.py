"""Decode's commit gate: a transfer that reported success stays in SGLang's transfer queue until the checks that
read device memory have their answers on the host, and a refusal fails the transfer on every TP rank.

The page-tag, canary and checksum guards judge a finished transfer by what decode's GPU holds (the page table
row, the stamps, the KV bytes). Reading that at commit would make the scheduler thread wait for the stream, with
the forward in flight. Instead, when a receiver first reports ``Success``, each armed step *launches* its device
work (copies into pinned memory, kernels on a private stream) and the receiver keeps answering ``Transferring``
until every step can *decide* from what landed on the host (:class:`~sglang_harden.kernels.device.HostCopy`,
polled each scheduler loop pass, never waited on). A request therefore commits one or more loop passes later
than it would unguarded; nothing else waits.

TP ranks agree without an extra collective: SGLang already all-reduces every receiver's poll with MIN each pass.
A rank still waiting answers ``Transferring`` (everyone waits); a rank whose step refuses records the reason as
the room's transfer failure and answers ``Failed`` (everyone fails the transfer through SGLang's own failure
path, which aborts the request with HTTP 500 and the reason, before its first decode step).

Steps run in :data:`ORDER` (cheapest first); each records its decision once. Hooks: the receiver's ``poll``
(``CommonKVReceiver.poll``) and the transfer queue's ``pop_transferred`` (which requests are in the queue), both
installed by the first step that joins, like :mod:`.commit_chain`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from sglang_harden import events
from sglang_harden.compat.hooks import Hook
from sglang_harden.compat.internals import CONN, POP_TRANSFERRED
from sglang_harden.compat.runtime import RUNTIME
from sglang_harden.guards.base import Decision

Func = Callable[..., Any]
ORDER = ("page_tags", "canary", "checksum")
GATE_MARK = "__sglang_harden_commit_gate__"
RECEIVER_POLL = (CONN, "CommonKVReceiver.poll")


class Step(Protocol):
    """One guard's part of the gate."""

    def launch(self, queue: Any, decode_req: Any) -> Any:
        """Start the device work for ``decode_req``'s finished transfer; whatever :meth:`decide` needs later."""

    def decide(self, queue: Any, decode_req: Any, pending: Any) -> Decision | None:
        """The decision once the work landed; None while it has not."""


@dataclass
class Entry:
    """A room waiting at the gate: each step's pending work and the decisions made so far."""

    since: float
    pending: dict[str, Any] = field(default_factory=dict)
    decided: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Polls:
    success: Any
    transferring: Any
    failed: Any


_POLLS: list[Polls] = []
_TALLIES: dict[int, events.Tally] = {}  # id of a constant ALLOW decision -> its tally (the hot path's count)


def count_allows(tally: events.Tally) -> None:
    """A step's constant ALLOW decision is counted by ``tally`` (a bump, not a full record)."""
    _TALLIES[id(tally.decision)] = tally


def _record(decision: Decision, mode: Any, **context: Any) -> bool:
    tally = _TALLIES.get(id(decision))
    if tally is not None and tally.decision is decision:
        tally.bump(mode, **context)
        return False
    return events.record(decision, mode, **context)


def _polls() -> Polls:
    if not _POLLS:
        from sglang.srt.disaggregation.base.conn import KVPoll

        _POLLS.append(Polls(KVPoll.Success, KVPoll.Transferring, KVPoll.Failed))
    return _POLLS[0]


class CommitGate:
    """The steps joined so far and the rooms waiting."""

    def __init__(self) -> None:
        self.steps: dict[str, tuple[Step, str]] = {}  # name -> (step, owning guard)
        self.entries: dict[int, Entry] = {}
        self.queued: dict[int, Any] = {}  # room -> SGLang's DecodeRequest, as of this pass
        self.queue: Any = None

    def join(self, name: str, step: Step, guard: str) -> None:
        if name not in ORDER:
            raise ValueError(f"commit gate: unknown step {name!r} (known: {ORDER})")
        self.steps[name] = (step, guard)

    def joined(self) -> tuple[str, ...]:
        return tuple(name for name in ORDER if name in self.steps)

    # ---- the transfer queue's pass (scheduler thread)
    def see_queue(self, queue: Any) -> None:
        self.queue = queue
        self.queued = {}
        for decode_req in queue.queue:
            room = getattr(decode_req.req, "bootstrap_room", None)
            if room is not None:
                self.queued[int(room)] = decode_req
        for room in [room for room in self.entries if room not in self.queued]:
            del self.entries[room]  # aborted, failed or committed: its pending work is dropped

    # ---- a receiver's poll (scheduler thread)
    def gate(self, receiver: Any, status: Any) -> Any:
        polls = _polls()
        room = getattr(receiver, "bootstrap_room", None)
        if status != polls.success or room is None or not self.steps:
            return status
        decode_req = self.queued.get(int(room))
        if decode_req is None or decode_req.kv_receiver is not receiver or _is_fake_transfer(decode_req.req):
            return status
        entry = self.entries.get(int(room))
        if entry is None:
            entry = self.entries[int(room)] = self._launch(decode_req)
        for name in self.joined():
            if name in entry.decided:
                continue
            step, guard = self.steps[name]
            decision = step.decide(self.queue, decode_req, entry.pending.get(name))
            if decision is None:
                return polls.transferring
            entry.decided.add(name)
            if _record(decision, RUNTIME.config.mode(guard), room=room, rid=decode_req.req.rid):
                self.entries.pop(int(room), None)
                _fail_transfer(receiver, int(room), guard, decision)
                return polls.failed
        return status

    def _launch(self, decode_req: Any) -> Entry:
        entry = Entry(time.monotonic())
        for name in self.joined():
            step, _guard = self.steps[name]
            entry.pending[name] = step.launch(self.queue, decode_req)
        return entry


GATE = CommitGate()


def _is_fake_transfer(req: Any) -> bool:
    """SGLang's own warm-up pairs decode with an in-process fake transfer that sends no KV at all."""
    from sglang.srt.disaggregation.utils import _is_fake_transfer as is_fake

    return bool(is_fake(req))


CHECK_NAMES = {"page_tags": "page ownership check", "canary": "canary check", "checksum": "KV checksum check"}


def _fail_transfer(receiver: Any, room: int, guard: str, decision: Decision) -> None:
    """The room's transfer fails with the guard's reason (SGLang reports it when it aborts the request)."""
    receiver.kv_mgr.record_failure(room, f"sglang-harden {CHECK_NAMES.get(guard, guard)} failed: {decision.reason}")


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


def hooks(owner: str, name: str, step: Step, gate: CommitGate = GATE) -> list[Hook]:
    """``owner``'s hooks for its gate ``step``: the step joins the gate when the first of them is installed."""

    def joined(make: Callable[[Func], Func]) -> Callable[[Func], Func]:
        def install(original: Func) -> Func:
            gate.join(name, step, owner)
            return make(original)

        install.times_itself = True  # type: ignore[attr-defined]
        return install

    return [Hook(owner, *RECEIVER_POLL, ("self",), joined(_gate_poll(gate))),
            Hook(owner, *POP_TRANSFERRED, ("self",), joined(_see_queue(gate)))]
