"""Decode's commit of a finished transfer (``DecodeTransferQueue._commit_transfer_to_req``): one wrapper running an
explicit, ordered list of steps, instead of wrappers stacked in the order their hooks happened to be listed.

The order: the page ledger learns the transfer finished (the lifecycle guard's, or the page-tag guard's when
lifecycle is off); then coverage, which may refuse (it reads the metadata buffers, host memory); SGLang's commit.
The first refusal aborts the request and ends the chain. A step runs when its guard's hook joined the chain,
whatever else is armed; steps hand each other a per-commit context, never an attribute set on SGLang's objects.
The checks that read device memory (page tags, canary, checksum) decide earlier, at the commit gate
(:mod:`.commit_gate`), so that nothing here waits for the GPU; the chain's last step makes sure of it (a transfer that
did not pass the gate is judged here, waiting: see :meth:`.gate.CommitGate.judge_at_commit`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from sglang_harden.compat import hook_timer
from sglang_harden.compat.hooks import Hook
from sglang_harden.compat.internals import COMMIT

Func = Callable[..., Any]
# (the transfer queue, SGLang's DecodeRequest, this commit's context) -> True when it refused (and aborted) the request
Step = Callable[[Any, Any, dict[str, Any]], bool]

BEFORE_COMMIT = ("ledger", "coverage", "gate")
MODULE, QUALNAME = COMMIT
PARAMS = ("self", "decode_req")
TARGET = f"{MODULE}.{QUALNAME}"
CHAIN_MARK = "__sglang_harden_commit_chain__"


class CommitChain:
    """The steps joined so far, by name; ``around(commit)`` is SGLang's commit with them in their order."""

    def __init__(self) -> None:
        self.steps: dict[str, Step] = {}

    def join(self, name: str, step: Step) -> None:
        if name not in BEFORE_COMMIT:
            raise ValueError(f"commit chain: unknown step {name!r} (known: {BEFORE_COMMIT})")
        self.steps[name] = step

    def joined(self) -> tuple[str, ...]:
        return tuple(name for name in BEFORE_COMMIT if name in self.steps)

    def around(self, commit: Func) -> Func:
        def chained_commit(queue: Any, decode_req: Any) -> Any:
            context: dict[str, Any] = {}
            for name in BEFORE_COMMIT:
                step = self.steps.get(name)
                if step is not None and step(queue, decode_req, context):
                    return None
            return commit(queue, decode_req)

        setattr(chained_commit, CHAIN_MARK, True)
        return chained_commit


CHAIN = CommitChain()


def hook(owner: str, name: str, step: Step) -> Hook:
    """``owner``'s hook on decode's commit: its ``step`` joins the chain as ``name``."""
    return Hook(owner, MODULE, QUALNAME, PARAMS, join(name, owner, step))


def join(name: str, guard: str, step: Step, chain: CommitChain = CHAIN) -> Func:
    """A hook's wrapper factory: ``guard``'s ``step`` joins the chain, which is installed around SGLang's commit
    by the first hook to join (the others find it there). The step is timed under ``guard`` when that guard's
    hooks are timed (``SGLANG_HARDEN_TIME_HOOKS``)."""

    def make(original: Func) -> Func:
        chain.join(name, _timed(step, guard))
        return original if getattr(original, CHAIN_MARK, False) else chain.around(original)

    make.times_itself = True  # type: ignore[attr-defined]  # hooks.py: no timer around the whole chain
    return make


def _timed(step: Step, guard: str) -> Step:
    if guard not in hook_timer.timed_owners():
        return step
    key = f"{TARGET}#{guard}"

    def timed_step(queue: Any, decode_req: Any, context: dict[str, Any]) -> bool:
        began = time.perf_counter()
        try:
            return step(queue, decode_req, context)
        finally:
            hook_timer.TIMER.add(key, time.perf_counter() - began)

    return timed_step
