"""Decode's commit gate (``compat/gate.py``) with stand-in steps and SGLang's poll states as plain values: a
finished transfer waits (``Transferring``) until every step decided, each step is launched once and decides once,
in the gate's order; an enforced refusal fails the transfer with the guard's reason, a logged one lets it commit;
rooms that left the queue are dropped; receivers the queue does not hold, and fake transfers, pass untouched."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from sglang_harden.compat.gate import CommitGate, GateWiring
from sglang_harden.guards.base import Decision, Verdict, allow

SUCCESS, TRANSFERRING, FAILED = 4, 3, 0


def _wiring(enforced: bool = True) -> GateWiring:
    """Plain poll states; a decision refuses when it does not allow and ``enforced``."""
    return GateWiring(SUCCESS, TRANSFERRING, FAILED, lambda req: getattr(req, "fake", False),
                      lambda decision, guard, room, rid: enforced and not decision.allows)


class Step:
    """Decides ``decision`` after ``passes`` polls; counts launches and decisions."""

    def __init__(self, guard: str, decision: Decision | None = None, passes: int = 0) -> None:
        self.decision = decision or allow(guard)
        self.passes, self.launched, self.decided, self.log = passes, 0, 0, []

    def launch(self, queue: Any, decode_req: Any) -> Any:
        self.launched += 1
        return {"left": self.passes}

    def decide(self, queue: Any, decode_req: Any, pending: Any) -> Decision | None:
        if pending["left"] > 0:
            pending["left"] -= 1
            return None
        self.decided += 1
        return self.decision


def _queue(*rooms: int) -> tuple[Any, dict[int, Any]]:
    receivers = {}
    entries = []
    for room in rooms:
        failures: list[str] = []
        receiver = SimpleNamespace(bootstrap_room=room, failures=failures,
                                   kv_mgr=SimpleNamespace(record_failure=lambda r, why, f=failures: f.append(why)))
        receivers[room] = receiver
        entries.append(SimpleNamespace(req=SimpleNamespace(rid=f"r{room}", bootstrap_room=room), kv_receiver=receiver))
    return SimpleNamespace(queue=entries), receivers


def test_a_finished_transfer_waits_until_every_step_decided() -> None:
    gate = CommitGate(_wiring())
    slow, fast = Step("checksum", passes=2), Step("canary")
    gate.join("checksum", slow, "checksum")
    gate.join("canary", fast, "canary")
    queue, receivers = _queue(7)
    answers = []
    for _ in range(4):
        gate.see_queue(queue)
        answers.append(gate.gate(receivers[7], SUCCESS))
    assert answers == [TRANSFERRING, TRANSFERRING, SUCCESS, SUCCESS]
    assert (slow.launched, fast.launched) == (1, 1) and (slow.decided, fast.decided) == (1, 1)
    assert gate.gate(receivers[7], TRANSFERRING) == TRANSFERRING, "only a success is held"


def test_an_enforced_refusal_fails_the_transfer_with_the_reason() -> None:
    refusal = Decision("canary", Verdict.ABORT, "2 reserved pages never written", 500)
    gate = CommitGate(_wiring())
    gate.join("canary", Step("canary", refusal), "canary")
    later = Step("checksum")
    gate.join("checksum", later, "checksum")
    queue, receivers = _queue(9)
    gate.see_queue(queue)
    assert gate.gate(receivers[9], SUCCESS) == FAILED
    assert receivers[9].failures and "sglang-harden canary check failed" in receivers[9].failures[0]
    assert later.decided == 0, "the first refusal ends the gate"
    logged = CommitGate(_wiring(enforced=False))
    logged.join("canary", Step("canary", refusal), "canary")
    queue, receivers = _queue(10)
    logged.see_queue(queue)
    assert logged.gate(receivers[10], SUCCESS) == SUCCESS and not receivers[10].failures


def test_rooms_that_left_the_queue_are_dropped_and_strangers_pass() -> None:
    gate = CommitGate(_wiring())
    gate.join("canary", Step("canary", passes=5), "canary")
    queue, receivers = _queue(1, 2)
    gate.see_queue(queue)
    assert gate.gate(receivers[1], SUCCESS) == TRANSFERRING
    queue.queue.pop(0)
    gate.see_queue(queue)
    assert 1 not in gate.entries
    stranger = SimpleNamespace(bootstrap_room=99)
    assert gate.gate(stranger, SUCCESS) == SUCCESS
    queue.queue[0].req.fake = True
    assert gate.gate(receivers[2], SUCCESS) == SUCCESS


def test_an_unknown_step_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown step"):
        CommitGate().join("spellcheck", Step("x"), "x")


def test_an_unwired_gate_lets_every_poll_through() -> None:
    gate = CommitGate()
    gate.join("canary", Step("canary", passes=5), "canary")
    queue, receivers = _queue(3)
    gate.see_queue(queue)
    assert gate.gate(receivers[3], SUCCESS) == SUCCESS


def test_a_transfer_that_bypassed_the_gate_is_judged_at_the_commit() -> None:
    refusal = Decision("canary", Verdict.ABORT, "1 reserved page never written", 500)
    gate = CommitGate(_wiring())
    gate.join("page_tags", Step("page_tags", passes=3), "page_tags")
    gate.join("canary", Step("canary", refusal), "canary")
    queue, receivers = _queue(4, 5)
    gate.see_queue(queue)
    assert gate.judge_at_commit(queue, queue.queue[0]) == ("canary", refusal), "waited for, then refused"
    clean = CommitGate(_wiring())
    clean.join("canary", Step("canary"), "canary")
    clean.see_queue(queue)
    assert clean.gate(receivers[5], SUCCESS) == SUCCESS and 5 in clean.passed
    assert clean.judge_at_commit(queue, queue.queue[1]) is None and 5 not in clean.passed
    assert clean.judge_at_commit(queue, queue.queue[0]) is None, "not passed: judged now, and allowed"


def test_judge_polls_maps_each_poller_to_its_receiver() -> None:
    gate = CommitGate(_wiring())
    gate.join("canary", Step("canary", passes=1), "canary")
    queue, receivers = _queue(6, 7)
    gate.see_queue(queue)
    wrapped = SimpleNamespace(decode_req=queue.queue[1])  # SGLang's hicache wrapper holds the decode request
    assert gate.judge_polls([receivers[6], wrapped], [SUCCESS, TRANSFERRING]) == [TRANSFERRING, TRANSFERRING]
    assert gate.judge_polls([receivers[6], wrapped], [SUCCESS, SUCCESS]) == [SUCCESS, TRANSFERRING]
