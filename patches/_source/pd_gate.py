"""Decode's commit gate (sglang-harden backport, not upstream SGLang code).

The page-tag, canary and KV-digest checks read decode's GPU memory (the page table row, the stamps, the KV bytes).
Read at the commit they would make the scheduler thread wait for the stream while the model's forward is in
flight. With this patch, when a transfer first reports success each check starts its device work (copies into
pinned memory, kernels on a private stream) and the transfer answers ``Transferring`` until every check can decide
from what landed on the host (polled each scheduler pass, never waited on):

- ``judge_polls`` (``_poll_with_failure_injection``, where every receiver is polled before the polls are
  all-reduced across decode's TP ranks): a refusal fails the transfer with its reason on that rank, and the MIN
  all-reduce fails it on every rank, so the ranks agree without a collective of their own;
- ``see_queue`` (the transfer queue's ``pop_transferred``): which requests are in the queue;
- ``refusal_at_commit`` (``_commit_transfer_to_req``): a transfer that reached the commit without passing the gate
  (a poll path it does not see) is judged there, waiting -- never committed unjudged.

The checks are the page-tags, canary and kv-digest patches' modules (``GATE_STEP`` in each, in its mode); the gate's
rule is sglang-harden's own code (``compat/gate.py``), put in below when the series is generated, so a patched and a
plugin decode gate alike.
"""

from __future__ import annotations

import importlib
import logging
import os
from enum import Enum

logger = logging.getLogger(__name__)

# the checks, each in its patch's module and mode
STEP_MODULES = (("page_tags", "sglang.srt.mem_cache.pd_page_tags"),
                ("canary", "sglang.srt.disaggregation.common.pd_canary"),
                ("checksum", "sglang.srt.disaggregation.common.pd_digest"))

# <prelude>


# <bundle sglang_harden/guards/base.py sglang_harden/compat/gate.py>


# ---- the backport's own glue: SGLang's objects in, the guard's decisions out


GATE = CommitGate()
_MODES: dict[str, str] = {}


def _record(decision: Decision, guard: str, room: Any, rid: Any) -> bool:
    """Log a refusal (and skip) as the plugin does; True when it is enforced."""
    mode = _MODES.get(guard, "enforce")
    if decision.verdict is Verdict.SKIP:
        logger.warning("sglang-harden %s skip: rid=%s room=%s: %s", guard, rid, room, decision.reason)
    if decision.allows:
        return False
    logger.error("sglang-harden %s %s: rid=%s room=%s: %s", guard,
                 "abort" if mode == "enforce" else "abort_logged (log mode: decoding anyway)", rid, room,
                 decision.reason)
    return mode == "enforce"


def _ready() -> bool:
    """Wire the gate and join the checks present in this tree (on first use, in the scheduler process)."""
    if GATE.wiring is None:
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.utils import _is_fake_transfer

        GATE.wire(GateWiring(KVPoll.Success, KVPoll.Transferring, KVPoll.Failed, _is_fake_transfer, _record))
        for guard, module_name in STEP_MODULES:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            step, mode = getattr(module, "GATE_STEP", None), getattr(module, "MODE", "off")
            if step is not None and mode != "off":
                GATE.join(guard, step, guard)
                _MODES[guard] = mode
    return bool(GATE.steps)


def see_queue(queue: Any) -> None:
    if _ready():
        GATE.see_queue(queue)


def judge_polls(pollers: Any, polls: list[int]) -> list[int]:
    return GATE.judge_polls(pollers, polls) if GATE.steps else polls


def refusal_at_commit(queue: Any, decode_req: Any) -> str | None:
    """The message to abort a transfer with that did not pass the gate and is refused now (None: commit it)."""
    if not _ready():
        return None
    room = getattr(decode_req.req, "bootstrap_room", None)
    if room is not None and int(room) not in GATE.passed and not GATE.wiring.is_fake(decode_req.req):
        logger.warning("sglang-harden commit gate: room %s reached the commit without passing the gate; judging it "
                       "now (a host synchronisation)", room)
    try:
        refused = GATE.judge_at_commit(queue, decode_req)
    except TimeoutError as exc:
        return f"sglang-harden commit gate: {exc}"
    return None if refused is None else refusal_message(*refused)
