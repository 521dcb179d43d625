"""Coverage guard: decode commits a transfer only if prefill sent KV for exactly the tokens decode reserved.

Invariant: before decode turns a finished transfer into a running request, the number of tokens whose KV
prefill actually sent (published by prefill, cached prefix included) equals the number of tokens decode
reserved pages for. Anything else (the 1-token stub of a rejected request, ``--allow-auto-truncate``, a
short send) aborts the request. An unknown count fails closed.

Carrying the count: prefill writes ``encode_coverage(tokens, room)`` into a spare 32-bit int slot of
SGLang's metadata buffer (e.g. ``cached_tokens[idx][15]``), which travels with the rest of the request's
metadata. The slot is reused by later requests and starts at zero, so the value is bound to the bootstrap
room:

    bit  31..30   marker 0b10   (a zero slot, or a small count written by upstream code, never decodes)
    bits 29..22   tag           8 bits of a 64-bit mix of (room, tokens)
    bits 21..0    tokens        up to 4,194,303

returned as a signed int so it fits an int32 tensor. ``decode_coverage`` accepts the value only if the
marker and the tag for *this* room match: a stale value left by the slot's previous occupant (another
room) is rejected except with probability 2**-8, and even then it must also equal the reserved length to
pass the commit check. ``bits=64`` gives a 30-bit tag and 32-bit counts for an int64 slot.
"""

from __future__ import annotations

from sglang_harden.guards.base import Decision, Verdict, allow

GUARD = "coverage"

_MARKER = 0b10
_LAYOUTS: dict[int, tuple[int, int]] = {32: (22, 8), 64: (32, 30)}  # bits -> (token bits, tag bits)
_U64 = (1 << 64) - 1


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


def _mix(room: int, tokens: int) -> int:
    """splitmix64 finalizer over room and token count: cheap, well spread, deterministic across processes."""
    z = ((room & _U64) * 0x9E3779B97F4A7C15 + tokens) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def _layout(bits: int) -> tuple[int, int]:
    if bits not in _LAYOUTS:
        raise ValueError(f"coverage slots are 32 or 64 bits wide, not {bits}")
    return _LAYOUTS[bits]


def max_encodable_tokens(bits: int = 32) -> int:
    return (1 << _layout(bits)[0]) - 1


def encode_coverage(tokens: int, room: int, bits: int = 32) -> int:
    """The signed ``bits``-wide value that says "KV for ``tokens`` tokens was sent for ``room``"."""
    token_bits, tag_bits = _layout(bits)
    if not 0 <= tokens < (1 << token_bits):
        raise ValueError(f"coverage {tokens} does not fit {token_bits} bits")
    tag = _mix(room, tokens) & ((1 << tag_bits) - 1)
    unsigned = (_MARKER << (bits - 2)) | (tag << token_bits) | tokens
    return unsigned - (1 << bits) if unsigned >> (bits - 1) else unsigned


def decode_coverage(value: int, room: int, bits: int = 32) -> int | None:
    """The token count in ``value`` if it was written for ``room``; None if zero, stale or foreign."""
    token_bits, tag_bits = _layout(bits)
    unsigned = value & ((1 << bits) - 1)
    if unsigned >> (bits - 2) != _MARKER:
        return None
    tokens = unsigned & ((1 << token_bits) - 1)
    tag = (unsigned >> token_bits) & ((1 << tag_bits) - 1)
    if tag != _mix(room, tokens) & ((1 << tag_bits) - 1):
        return None
    return tokens
