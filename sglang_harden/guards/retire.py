"""Retire guard: an aborted or rejected prefill result never sends its last KV chunk.

Invariant: ``send_kv_chunk(last_chunk=True)`` (the message that tells decode "your KV is complete") runs only
for a request with no pending rejection and no abort. Otherwise the sender is failed, so that decode learns of
the failure through the backend's own failure path instead of committing a transfer that never happened.
"""

from __future__ import annotations

from dataclasses import dataclass

from sglang_harden.guards.admission import PendingRejection
from sglang_harden.guards.base import Decision, Verdict, allow

GUARD = "retire"


@dataclass(frozen=True)
class RetireView:
    rid: str
    pending: PendingRejection | None
    aborted: bool


def decide_final_send(view: RetireView) -> Decision:
    """ALLOW the final KV send, or ABORT: skip it and fail the sender (``fields['fail_sender']``)."""
    if view.pending is not None:
        reason = f"request {view.rid} has a pending rejection: {view.pending.message}"
        fields = {"rid": view.rid, "fail_sender": True}
        return Decision(GUARD, Verdict.ABORT, reason, view.pending.status_code, fields)
    if view.aborted:
        reason = f"request {view.rid} was aborted before its final KV chunk"
        return Decision(GUARD, Verdict.ABORT, reason, 500, {"rid": view.rid, "fail_sender": True})
    return allow(GUARD, rid=view.rid)
