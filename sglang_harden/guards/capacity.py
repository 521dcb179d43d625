"""Capacity gate: a node never advertises a context length its KV pool cannot hold.

Invariant: at start-up, ``max_req_input_len >= context_len - margin``, where ``margin`` is what SGLang
itself subtracts when the pool is large enough (``max_req_input_len = min(context_len - 1,
max_total_num_tokens - 1) - 5``, so 6). A node whose pool is smaller refuses to start (enforce), lowers
its context length to what fits (clamp), or warns (log). The incident needed exactly this gap: a prompt
that fits the advertised context but not the pool.

Every prompt a node advertises (``< max_req_input_len``) should also be one its scheduler can admit on an idle pool
(:func:`largest_servable_prompt`); paging and decode's reserved tokens lower that below ``max_req_input_len`` when
the pool is about the size of the context, and a prompt in that gap waits, neither admitted nor refused, until the
PD waiting timeout (issue 40 (a)). The admission doors refuse such a prompt at once (``guards.admission``); at
start-up :func:`decide_servable` names the configuration in a counted warning (the node still serves every other
prompt), as ``sglang-harden audit`` does (finding ``prompt_limit_unservable``).
"""

from __future__ import annotations

from sglang_harden.config import CapacityMode, Mode
from sglang_harden.guards.base import Decision, Verdict, allow

GUARD = "capacity"
SGLANG_MARGIN = 6
FIX_FLAGS = ("--max-total-tokens", "--mem-fraction-static", "--context-length", "--harden-capacity clamp")
# Prefill runs every PD request with max_new_tokens = 1 (PrefillBootstrapQueue._process_req).
PREFILL_NEW_TOKENS = 1


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


# ------------------------------------------------------------------ the largest prompt the pool can ever serve


def largest_servable_prompt(role: str, pool_tokens: int, page_size: int, reserved_decode_tokens: int = 0) -> int | None:
    """The longest prompt a PD node's scheduler admits on an idle pool of ``pool_tokens`` (None: role not modelled).

    prefill (``PrefillAdder.add_one_req``): ``L + max_new (1) + page_size < available + evictable``, the pool at
    most, checked on the whole prompt before any chunking, so ``L <= pool - page_size - 2``.
    decode (``DecodePreallocQueue.pop_preallocated``): the page-rounded prompt plus the reserved decode tokens
    fit the allocatable tokens, the pool at most: ``ceil_page(L) + reserved <= pool``.
    A longer prompt is neither admitted nor refused: it waits until the PD waiting timeout.
    """
    page = max(1, page_size)
    if role == "prefill":
        return pool_tokens - page - PREFILL_NEW_TOKENS - 1
    if role == "decode":
        return (pool_tokens - reserved_decode_tokens) // page * page
    return None


def largest_advertised_prompt(max_req_input_len: int) -> int:
    """SGLang refuses a prompt of ``max_req_input_len`` tokens or more: the longest it accepts is one less."""
    return max_req_input_len - 1


def _servable_reason(role: str, advertised: int, servable: int) -> str:
    return (
        f"KV pool cannot serve the advertised prompt limit: this {role} node accepts prompts up to {advertised} "
        f"tokens (max_req_input_len={advertised + 1}) but its pool serves at most {servable} once paging"
        f"{' and reserved decode tokens' if role == 'decode' else ''} are counted (servable_prompt={servable}); "
        f"the admission doors refuse a prompt of {servable + 1}..{advertised} tokens with 400. Raise "
        "--max-total-tokens or --mem-fraction-static, or lower --context-length to "
        f"{servable + 1 + SGLANG_MARGIN}"
    )


def decide_servable(role: str, servable: int | None, max_req_input_len: int, mode: CapacityMode) -> Decision:
    """ALLOW when every advertised prompt is servable, else the start-up warning (verdict REJECT,
    ``fields['log_only']``: the node starts; the doors refuse the prompts in the gap). OFF decides nothing."""
    fields: dict[str, object] = {"check": "servable_prompt", "role": role, "max_req_input_len": max_req_input_len,
                                 "servable_prompt": servable}
    advertised = largest_advertised_prompt(max_req_input_len)
    if mode is CapacityMode.OFF or servable is None or advertised <= servable:
        return allow(GUARD, **fields)
    return Decision(GUARD, Verdict.REJECT, _servable_reason(role, advertised, servable), None,
                    {**fields, "log_only": True})
