"""The field readers of the PD side-channel checks (``wire_shapes``): what one ZMQ frame must look like for the
listener that reads it not to raise, stricter than SGLang's own reads (a legitimate sender always writes
``str(int)``, plain ASCII, ``host:port`` session ids), so that anything these accept SGLang's reads accept too.

Each reader returns the value or raises :class:`Malformed` with a short reason (never the frame's bytes).
Stdlib only.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

# ``str(int)`` as SGLang writes it: no sign but a leading minus, no leading zeros, no blanks, no underscores. 20
# digits hold any 64-bit value; Python's int() of a longer string is slower and, past 4300 digits, a ValueError.
_INT = re.compile(rb"(?:0|-?[1-9][0-9]{0,19})")
_TEXT = re.compile(rb"[\x21-\x7e]{1,255}")  # printable ASCII, no blanks: addresses, names, keys
_PORT_TAIL = re.compile(rb"(?:0|[1-9][0-9]{0,4})")

ROOM_MIN, ROOM_MAX = -(2**63), 2**64 - 1
U31 = 2**31 - 1
U63 = 2**63 - 1


class Malformed(ValueError):
    """A frame the listener would choke on (or that no legitimate sender writes)."""


def frame(frames: Sequence[bytes], index: int, what: str) -> bytes:
    if index >= len(frames):
        raise Malformed(f"{what}: missing frame {index}")
    return frames[index]


def integer(frames: Sequence[bytes], index: int, what: str, lo: int = ROOM_MIN, hi: int = ROOM_MAX) -> int:
    """The ASCII decimal at ``frames[index]``, within [lo, hi]."""
    raw = frame(frames, index, what)
    if not _INT.fullmatch(raw):
        raise Malformed(f"{what}: not a decimal integer")
    value = int(raw)
    if not lo <= value <= hi:
        raise Malformed(f"{what}: out of range")
    return value


def optional_integer(frames: Sequence[bytes], index: int, what: str, lo: int = ROOM_MIN,
                     hi: int = ROOM_MAX) -> int | None:
    """As :func:`integer`, but an absent or empty frame is None (SGLang's optional trailing fields)."""
    if index >= len(frames) or frames[index] == b"":
        return None
    return integer(frames, index, what, lo, hi)


def text(frames: Sequence[bytes], index: int, what: str) -> str:
    """Printable ASCII without blanks (1..255 characters): an address, an agent name, an engine key."""
    raw = frame(frames, index, what)
    if not _TEXT.fullmatch(raw):
        raise Malformed(f"{what}: not a printable ASCII word")
    return raw.decode("ascii")


def ascii_text(frames: Sequence[bytes], index: int, what: str, max_len: int = 4096) -> str:
    """Any ASCII (SGLang's ``.decode("ascii")``), bounded."""
    raw = frame(frames, index, what)
    if len(raw) > max_len:
        raise Malformed(f"{what}: too long")
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise Malformed(f"{what}: not ASCII") from None


def port(frames: Sequence[bytes], index: int, what: str) -> int:
    return integer(frames, index, what, 0, 65535)


def endpoint(frames: Sequence[bytes], ip_index: int, what: str) -> tuple[str, int]:
    """A decode reply address: ``frames[ip_index]`` the ip (or host), the next frame the port."""
    return text(frames, ip_index, f"{what} ip"), port(frames, ip_index + 1, f"{what} port")


def session_id(frames: Sequence[bytes], index: int, what: str) -> str:
    """A Mooncake session id, ``host:port``: prefill's scheduler thread int()s what follows the last ``:`` of every
    destination of a room (``add_transfer_request``), so anything else there kills the prefill server."""
    value = text(frames, index, what)
    host, sep, tail = value.rpartition(":")
    if not sep or not host or not _PORT_TAIL.fullmatch(tail.encode("ascii")) or int(tail) > 65535:
        raise Malformed(f"{what}: not host:port")
    return value


def packed_len(frames: Sequence[bytes], index: int, what: str, width: int, exact: int | None = None) -> bytes:
    """A struct-packed array frame: a whole number of ``width``-byte items (``exact``: exactly that many bytes)."""
    raw = frame(frames, index, what)
    if exact is not None and len(raw) != exact:
        raise Malformed(f"{what}: not {exact} bytes")
    if len(raw) % width:
        raise Malformed(f"{what}: not a whole number of {width}-byte items")
    return raw


def count(frames: Sequence[bytes], lo: int, hi: int, what: str) -> None:
    if not lo <= len(frames) <= hi:
        raise Malformed(f"{what}: {len(frames)} frames, expected {lo}..{hi}")
