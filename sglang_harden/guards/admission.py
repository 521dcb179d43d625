"""Admission guard: a request that is already rejected, or too long for this node, never enters the PD
handoff.

Invariant: at both PD admission doors (prefill bootstrap queue, decode prealloc queue) a request is
admitted only if it carries no pending rejection, its prompt fits this node's ``max_req_input_len``, and its
prompt is one this node's pool can ever admit (``servable``: paging and decode's reserved tokens put that below
``max_req_input_len`` on pools about the size of the context; such a prompt would otherwise wait, neither admitted nor
refused, until the PD waiting timeout). A rejected request is retired with its *original* error (message and
status), before any bootstrap, page allocation or KV transfer. If the node's limit is unknown the guard fails
closed: an unknown limit is not a reason to admit.

Prefill's HTTP front (its tokenizer) refuses earlier still a prompt its scheduler is certain to refuse as too long
for the pool, so the refusal does not wait for a scheduler loop that takes seconds on a busy node. The front knows
less (no pending rejection, the limit only once the scheduler reported it), so it refuses only what it is sure
of and leaves every other decision to the doors.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_harden.guards.base import Decision, Verdict, allow

GUARD = "admission"


@dataclass(frozen=True)
class PendingRejection:
    """An error SGLang already decided on (``to_finish``, ``finished_reason`` or the 0.4.x stub)."""

    message: str
    status_code: int = 400


@dataclass(frozen=True)
class AdmissionView:
    """What the door knows about one request. ``limit`` is the node's ``max_req_input_len``; ``servable`` the longest
    prompt its pool can ever admit (``guards.capacity.largest_servable_prompt``; None: not modelled for the role)."""

    rid: str
    role: str
    prompt_len: int
    pending: PendingRejection | None
    limit: int | None
    servable: int | None = None


def too_long_message(prompt_len: int, limit: int) -> str:
    return f"Input length ({prompt_len} tokens) exceeds the maximum allowed length ({limit} tokens)."


SCHEDULER_ADVICE = " Use a shorter input or enable --allow-auto-truncate."


def unservable_message(prompt_len: int, servable: int, role: str) -> str:
    return (f"Input length ({prompt_len} tokens) exceeds the longest prompt this {role} node's KV pool can admit "
            f"({servable} tokens, after paging and reserved tokens). Use a shorter input.")


@dataclass(frozen=True)
class FrontView:
    """What prefill's tokenizer knows of one request: its prompt length and the scheduler's ``max_req_input_len``
    (None: not reported yet), and whether the server truncates long prompts instead of refusing them."""

    rid: str
    prompt_len: int | None
    limit: int | None
    truncates: bool


def decide_at_front(view: FrontView) -> Decision:
    """REJECT a prompt SGLang's prefill scheduler will refuse as too long (its own check: ``len >= limit``), with
    the scheduler's own message; ALLOW anything else (the scheduler and the doors decide it)."""
    context = {"rid": view.rid, "role": "prefill", "door": "front", "prompt_len": view.prompt_len,
               "limit": view.limit}
    if view.truncates or view.limit is None or view.prompt_len is None or view.prompt_len < view.limit:
        return allow(GUARD, **context)
    return Decision(GUARD, Verdict.REJECT, too_long_message(view.prompt_len, view.limit) + SCHEDULER_ADVICE, 400,
                    context)


def decide_admission(view: AdmissionView) -> Decision:
    """ALLOW the request through this door, or REJECT it with the error its client must see."""
    context = {"rid": view.rid, "role": view.role, "prompt_len": view.prompt_len, "limit": view.limit}
    if view.pending is not None:
        return Decision(GUARD, Verdict.REJECT, view.pending.message, view.pending.status_code, context)
    if view.limit is None:
        reason = f"{view.role} does not know its max_req_input_len; refusing rather than admitting blind"
        return Decision(GUARD, Verdict.REJECT, reason, 500, context)
    if view.prompt_len > view.limit:
        return Decision(GUARD, Verdict.REJECT, too_long_message(view.prompt_len, view.limit), 400, context)
    if view.servable is not None and view.prompt_len > view.servable:
        reason = unservable_message(view.prompt_len, view.servable, view.role)
        return Decision(GUARD, Verdict.REJECT, reason, 400, {**context, "servable": view.servable})
    return allow(GUARD, **context)
