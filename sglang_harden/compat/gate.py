"""Decode's commit gate, the rule both the plugin (``compat/commit_gate.py``) and the backport series (its
``pd_gate`` module, generated from this file) run: a transfer that reported success stays in SGLang's transfer queue
until the checks that read device memory have their answers on the host, and a refusal fails the transfer.

The page-tag, canary and checksum guards judge a finished transfer by what decode's GPU holds (the page table
row, the stamps, the KV bytes). Reading that at commit would make the scheduler thread wait for the stream, with
the forward in flight. Instead, when a receiver first reports ``Success``, each step *launches* its device work
(copies into pinned memory, kernels on a private stream) and the receiver keeps answering ``Transferring`` until
every step can *decide* from what landed on the host (polled each scheduler loop pass, never waited on). A request
therefore commits one or more loop passes later than it would unguarded; nothing else waits.

TP ranks agree without an extra collective: SGLang already all-reduces every receiver's poll with MIN each pass.
A rank still waiting answers ``Transferring`` (everyone waits); a rank whose step refuses records the reason as
the room's transfer failure and answers ``Failed`` (everyone fails the transfer through SGLang's own failure path,
which aborts the request with HTTP 500 and the reason, before its first decode step).

Steps run in :data:`ORDER` (cheapest first); each decision is recorded once. What SGLang's names are, how a
decision is recorded and applied, is the caller's (:class:`GateWiring`): this module knows no SGLang name.

A request SGLang commits without its transfer having passed the gate (a poll path the gate does not see, e.g. the
pipeline-parallel consensus) is judged at the commit instead (:meth:`CommitGate.judge_at_commit`): the same steps,
waited for -- a host synchronisation, on that path only -- and never committed unjudged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from sglang_harden.guards.base import Decision

ORDER = ("page_tags", "canary", "checksum")
CHECK_NAMES = {"page_tags": "page ownership check", "canary": "canary check", "checksum": "KV checksum check"}


class Step(Protocol):
    """One guard's part of the gate."""

    def launch(self, queue: Any, decode_req: Any) -> Any:
        """Start the device work for ``decode_req``'s finished transfer; whatever :meth:`decide` needs later."""

    def decide(self, queue: Any, decode_req: Any, pending: Any) -> Decision | None:
        """The decision once the work landed; None while it has not."""


@dataclass(frozen=True)
class GateWiring:
    """What the gate needs from the code around it: SGLang's poll states, whether a request is SGLang's own warm-up
    (a fake transfer, nothing to check), and how a guard's decision is recorded (True: enforce its refusal)."""

    success: Any
    transferring: Any
    failed: Any
    is_fake: Callable[[Any], bool]
    record: Callable[[Decision, str, Any, Any], bool]  # (decision, guard, room, rid) -> refuse?


@dataclass
class Entry:
    """A room waiting at the gate: each step's pending work and the decisions made so far."""

    since: float
    pending: dict[str, Any] = field(default_factory=dict)
    decided: set[str] = field(default_factory=set)


def refusal_message(guard: str, decision: Decision) -> str:
    """The transfer failure SGLang reports when it aborts the request (HTTP 500)."""
    return f"sglang-harden {CHECK_NAMES.get(guard, guard)} failed: {decision.reason}"


class CommitGate:
    """The steps joined so far and the rooms waiting. ``wiring`` may come later (:meth:`wire`); until then the
    gate lets every poll through."""

    def __init__(self, wiring: GateWiring | None = None) -> None:
        self.wiring = wiring
        self.steps: dict[str, tuple[Step, str]] = {}  # name -> (step, owning guard)
        self.entries: dict[int, Entry] = {}
        self.queued: dict[int, Any] = {}  # room -> SGLang's DecodeRequest, as of this pass
        self.queue: Any = None
        self.passed: set[int] = set()  # rooms whose every step allowed (or only logged) the transfer

    def wire(self, wiring: GateWiring) -> None:
        self.wiring = wiring

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
        self.passed &= self.queued.keys()

    # ---- a receiver's poll (scheduler thread)
    def gate(self, receiver: Any, status: Any) -> Any:
        wiring = self.wiring
        room = getattr(receiver, "bootstrap_room", None)
        if wiring is None or status != wiring.success or room is None or not self.steps:
            return status
        decode_req = self.queued.get(int(room))
        if decode_req is None or decode_req.kv_receiver is not receiver or wiring.is_fake(decode_req.req):
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
                return wiring.transferring
            entry.decided.add(name)
            if wiring.record(decision, guard, room, decode_req.req.rid):
                self.entries.pop(int(room), None)
                receiver.kv_mgr.record_failure(int(room), refusal_message(guard, decision))
                return wiring.failed
        self.passed.add(int(room))
        return status

    def judge_polls(self, pollers: Sequence[Any], polls: list[int]) -> list[int]:
        """:meth:`gate` over one pass's polls of ``pollers`` (receivers, or SGLang's wrappers holding one as
        ``decode_req.kv_receiver``): the backport series' hook, where SGLang polls every receiver."""
        judged = []
        for poller, status in zip(pollers, polls, strict=True):
            decode_req = getattr(poller, "decode_req", None)
            receiver = decode_req.kv_receiver if decode_req is not None else poller
            judged.append(int(self.gate(receiver, status)))
        return judged

    def judge_at_commit(self, queue: Any, decode_req: Any, timeout_s: float = 30.0) -> tuple[str, Decision] | None:
        """At SGLang's commit: None when the room passed the gate (or has nothing to check); else the steps run and
        are waited for here (``timeout_s``: then the step is judged as not decided in time), and the first
        refusal, ``(guard, decision)``, is returned for the caller to abort the request with."""
        wiring = self.wiring
        room = getattr(decode_req.req, "bootstrap_room", None)
        if wiring is None or room is None or not self.steps or wiring.is_fake(decode_req.req):
            return None
        if int(room) in self.passed:
            self.passed.discard(int(room))
            return None
        self.queue = queue
        entry = self.entries.pop(int(room), None) or self._launch(decode_req)
        deadline = time.monotonic() + timeout_s
        for name in self.joined():
            if name in entry.decided:
                continue
            step, guard = self.steps[name]
            while (decision := step.decide(queue, decode_req, entry.pending.get(name))) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{CHECK_NAMES.get(guard, guard)} did not decide within {timeout_s} s")
                time.sleep(0.0005)
            if wiring.record(decision, guard, room, decode_req.req.rid):
                return guard, decision
        return None

    def _launch(self, decode_req: Any) -> Entry:
        entry = Entry(time.monotonic())
        for name in self.joined():
            step, _guard = self.steps[name]
            entry.pending[name] = step.launch(self.queue, decode_req)
        return entry
