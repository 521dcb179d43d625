"""Coverage guard: decode commits a transfer only if prefill sent KV for exactly the tokens decode reserved.

Invariant: before decode turns a finished transfer into a running request, the number of tokens whose KV
prefill actually sent (published by prefill, cached prefix included) equals the number of tokens decode
reserved pages for. Anything else (the 1-token stub of a rejected request, ``--allow-auto-truncate``, a
short send) aborts the request. An unknown count fails closed.

The count travels in a spare int slot of SGLang's metadata row, bound to the bootstrap room
(``channels/coverage_wire.py``: one encoding for the plugin and the backport series).
"""

from __future__ import annotations

from sglang_harden.channels.coverage_wire import (  # noqa: F401 - the guard's encoding, re-exported
    decode_coverage,
    encode_coverage,
    max_encodable_tokens,
)
from sglang_harden.guards.base import Decision, Verdict, allow

GUARD = "coverage"


def decide_commit(rid: str, reserved_tokens: int, sent_tokens: int | None) -> Decision:
    """ALLOW the commit only when prefill published coverage equal to what decode reserved; else ABORT."""
    fields = {"rid": rid, "reserved_tokens": reserved_tokens, "sent_tokens": sent_tokens}
    if sent_tokens is None:
        reason = (
            f"request {rid}: prefill did not publish how many tokens of KV it sent "
            f"(decode reserved {reserved_tokens}); refusing to decode over unverified pages"
        )
        return Decision(GUARD, Verdict.ABORT, reason, 500, fields)
    if sent_tokens != reserved_tokens:
        reason = (
            f"request {rid}: prefill sent KV for {sent_tokens} tokens but decode reserved {reserved_tokens}; "
            "the rest of the pages were never written by this request"
        )
        return Decision(GUARD, Verdict.ABORT, reason, 500, fields)
    return allow(GUARD, **fields)
