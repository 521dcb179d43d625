"""Capacity gate: a node never advertises a context length its KV pool cannot hold.

Invariant: at start-up, ``max_req_input_len >= context_len - margin``, where ``margin`` is what SGLang
itself subtracts when the pool is large enough (``max_req_input_len = min(context_len - 1,
max_total_num_tokens - 1) - 5``, so 6). A node whose pool is smaller refuses to start (enforce), lowers
its context length to what fits (clamp), or warns (log). The incident needed exactly this gap: a prompt
that fits the advertised context but not the pool.
"""

from __future__ import annotations

from sglang_harden.config import CapacityMode, Mode
from sglang_harden.guards.base import Decision, Verdict, allow

GUARD = "capacity"
SGLANG_MARGIN = 6
FIX_FLAGS = ("--max-total-tokens", "--mem-fraction-static", "--context-length", "--harden-capacity clamp")


def largest_fitting_context(max_req_input_len: int, margin: int = SGLANG_MARGIN) -> int:
    return max_req_input_len + margin


def _shortfall_reason(context_len: int, max_req_input_len: int, margin: int) -> str:
    fitting = largest_fitting_context(max_req_input_len, margin)
    return (
        f"KV pool too small for the configured context: max_req_input_len={max_req_input_len} but "
        f"context_len={context_len} needs at least {context_len - margin}. Raise --max-total-tokens or "
        f"--mem-fraction-static, lower --context-length to {fitting}, or start with --harden-capacity clamp"
    )


def decide_capacity(context_len: int, max_req_input_len: int, margin: int, mode: CapacityMode) -> Decision:
    """ALLOW, REJECT (refuse to start), CLAMP (``fields['context_len']``) or, in log mode, a warning decision.

    The log-mode decision carries ``fields['log_only'] = True`` and verdict REJECT; pass it to
    ``events.record`` with :func:`record_mode` so it is counted as ``reject_logged`` and not applied.
    """
    fields: dict[str, object] = {
        "context_len": context_len,
        "max_req_input_len": max_req_input_len,
        "margin": margin,
        "fix_flags": list(FIX_FLAGS),
    }
    if mode is CapacityMode.OFF or max_req_input_len >= context_len - margin:
        return allow(GUARD, **fields)
    reason = _shortfall_reason(context_len, max_req_input_len, margin)
    fitting = largest_fitting_context(max_req_input_len, margin)
    if mode is CapacityMode.CLAMP and max_req_input_len > 0:
        clamped = {**fields, "context_len": fitting, "original_context_len": context_len}
        return Decision(
            GUARD, Verdict.CLAMP, f"clamping context_len {context_len} -> {fitting}; " + reason, None, clamped
        )
    if mode is CapacityMode.LOG:
        return Decision(GUARD, Verdict.REJECT, reason, None, {**fields, "log_only": True})
    return Decision(GUARD, Verdict.REJECT, reason, None, fields)


def record_mode(mode: CapacityMode) -> Mode:
    """The ``events.record`` mode for a capacity decision: clamp and enforce apply, log only logs."""
    return {CapacityMode.LOG: Mode.LOG, CapacityMode.OFF: Mode.OFF}.get(mode, Mode.ENFORCE)
