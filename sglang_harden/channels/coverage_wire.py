"""The coverage count: how prefill tells decode, inside SGLang's own metadata row, for how many prompt tokens
its transfer carried KV. One encoding for the plugin and the backport series.

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

# ---- embedded in the backport series from here on

_COVERAGE_MARKER = 0b10
_COVERAGE_LAYOUTS = {32: (22, 8), 64: (32, 30)}  # slot bits -> (token bits, tag bits)
_U64 = (1 << 64) - 1


def _coverage_mix(room: int, tokens: int) -> int:
    """splitmix64 finalizer over room and token count: cheap, well spread, deterministic across processes."""
    z = ((room & _U64) * 0x9E3779B97F4A7C15 + tokens) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def _coverage_layout(bits: int) -> tuple[int, int]:
    if bits not in _COVERAGE_LAYOUTS:
        raise ValueError(f"coverage slots are 32 or 64 bits wide, not {bits}")
    return _COVERAGE_LAYOUTS[bits]


def max_encodable_tokens(bits: int = 32) -> int:
    return (1 << _coverage_layout(bits)[0]) - 1


def encode_coverage(tokens: int, room: int, bits: int = 32) -> int:
    """The signed ``bits``-wide value that says "KV for ``tokens`` tokens was sent for ``room``"."""
    token_bits, tag_bits = _coverage_layout(bits)
    if not 0 <= tokens < (1 << token_bits):
        raise ValueError(f"coverage {tokens} does not fit {token_bits} bits")
    tag = _coverage_mix(room, tokens) & ((1 << tag_bits) - 1)
    unsigned = (_COVERAGE_MARKER << (bits - 2)) | (tag << token_bits) | tokens
    return unsigned - (1 << bits) if unsigned >> (bits - 1) else unsigned


def decode_coverage(value: int, room: int, bits: int = 32) -> int | None:
    """The token count in ``value`` if it was written for ``room``; None if zero, stale or foreign."""
    token_bits, tag_bits = _coverage_layout(bits)
    unsigned = value & ((1 << bits) - 1)
    if unsigned >> (bits - 2) != _COVERAGE_MARKER:
        return None
    tokens = unsigned & ((1 << token_bits) - 1)
    tag = (unsigned >> token_bits) & ((1 << tag_bits) - 1)
    if tag != _coverage_mix(room, tokens) & ((1 << tag_bits) - 1):
        return None
    return tokens
