"""ZMQ side-channel authentication: only holders of the PD deployment's secret speak on a node's ZMQ rank ports.

Invariant: with a secret configured and the mode ``enforce``, a message reaches SGLang's side-channel listener only
when its last frame is the auth frame ``sghz1 | ts | seq | sender | mac``, where ``mac`` is HMAC-SHA256, under
one of the accepted secrets, of the destination endpoint (the rank port's ``host:port`` the sender addressed), the
sender id, ``ts``, ``seq`` and the SHA-256 of the message's other frames (each length-prefixed); ``ts`` is within
``max_age_s`` of the receiver's clock; and ``seq`` was not seen before from that sender (a sliding window per
sender). The MAC is compared in constant time and the auth frame is removed before SGLang reads the message.

The ports carry decode's registrations (where prefill writes a request's KV), the rooms' transfer infos, statuses,
abort notices and drain acks. The message type, room and session are inside the hashed frames, so the MAC binds
them; the destination binds the rank (a message signed for one rank is refused by every other); the sender id
(random per process) names the instance for the rules that depend on who sent (a registration may be replaced
only by an authenticated peer). Replays are refused by sequence number, not by a nonce cache: the ports carry
thousands of messages a second, and a window per sender costs a few hundred bytes where a nonce per message held
for two minutes would cost hundreds of megabytes.

Why an HMAC frame and not ZeroMQ CURVE (pyzmq's libzmq has it): one shared secret gives every peer the same CURVE
key, so CURVE names no sender; it cannot say which message may replace a registration or which rank may ack; it
has no log mode, so a fleet could not move to it without a flag day; rotating a server key means a new socket and
port; and every socket SGLang creates would have to be configured before ``bind``/``connect``, where one missed
site fails silently. The frame reuses the HTTP token's keyring, rotation and modes, with its own domain
(``sghz1``) so that an HTTP token's MAC never verifies here. CURVE would add confidentiality, which is worth having
only once the KV data plane is encrypted too (it is not: see docs/security.md).

Rollout: a frame an older peer does not expect breaks its parser, so a fleet moves ``accept`` (verify a signed
message, accept an unsigned one, sign nothing) -> ``log`` (sign; unsigned counted and served) -> ``enforce``.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import secrets
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from sglang_harden.guards.base import Decision, Verdict, allow
from sglang_harden.guards.bootstrap_auth import Keyring

GUARD = "zmq_auth"
MAGIC = b"sghz1"
SENDER_BYTES = 16
MAC_BYTES = 32
_HEAD = struct.Struct(">QQ")  # ts, seq
AUTH_FRAME_BYTES = len(MAGIC) + _HEAD.size + SENDER_BYTES + MAC_BYTES
DEFAULT_MAX_AGE_S = 60.0
WINDOW = 4096  # how far behind a sender's newest message one may arrive (its sockets are not ordered together)
MAX_SENDERS = 65_536


def new_sender_id() -> bytes:
    """A process's random instance id (what the receivers know it as)."""
    return secrets.token_bytes(SENDER_BYTES)


def canonical_endpoint(endpoint: str) -> str:
    """``tcp://[::1]:5000`` / ``tcp://10.0.0.5:5000`` / ``10.0.0.5:5000`` -> ``::1:5000`` / ``10.0.0.5:5000``."""
    text = endpoint.strip().lower().removeprefix("tcp://")
    host, _, port = text.rpartition(":")
    return f"{host.strip('[]')}:{port}"


def frames_digest(frames: Sequence[bytes]) -> bytes:
    h = hashlib.sha256()
    for frame in frames:
        h.update(struct.pack(">Q", len(frame)))
        h.update(frame)
    return h.digest()


def _mac(key: bytes, destination: str, sender: bytes, timestamp: int, seq: int, digest: bytes) -> bytes:
    head = MAGIC + b"\n" + destination.encode() + b"\n" + sender + _HEAD.pack(timestamp, seq)
    return hmac.new(key, head + digest, hashlib.sha256).digest()


class Signer:
    """One process's signing side: its sender id and a sequence counter per destination."""

    def __init__(self, sender: bytes | None = None) -> None:
        self.sender = sender or new_sender_id()
        self._counters: dict[str, itertools.count[int]] = {}
        self._lock = threading.Lock()

    def next_seq(self, destination: str) -> int:
        with self._lock:
            counter = self._counters.get(destination)
            if counter is None:
                counter = self._counters[destination] = itertools.count(1)
            return next(counter)

    def sign(self, keyring: Keyring, frames: Sequence[bytes], destination: str, *, now: float | None = None) -> bytes:
        """The auth frame for ``frames`` sent to ``destination`` (appended as the message's last frame)."""
        target = canonical_endpoint(destination)
        timestamp, seq = int(time.time() if now is None else now), self.next_seq(target)
        mac = _mac(keyring.signing, target, self.sender, timestamp, seq, frames_digest(frames))
        return MAGIC + _HEAD.pack(timestamp, seq) + self.sender + mac


@dataclass
class _Seen:
    newest: int
    bits: int  # bit i: newest - i was seen
    last_at: float


class ReplayWindow:
    """The sequence numbers seen from each sender, a sliding window of ``width`` behind its newest. A sender
    silent for longer than ``idle_s`` (past the messages' validity) is forgotten: its old messages are refused by
    age. Full of senders that are not idle: refuse a new one (never forget one early, which would allow replays)."""

    def __init__(self, idle_s: float, width: int = WINDOW, max_senders: int = MAX_SENDERS) -> None:
        self.idle_s = idle_s
        self.width = width
        self.max_senders = max_senders
        self._senders: OrderedDict[bytes, _Seen] = OrderedDict()
        self._lock = threading.Lock()

    def first_use(self, sender: bytes, seq: int, now: float) -> bool | None:
        """True: first use (now remembered); False: seen, or too far behind; None: too many senders to decide."""
        with self._lock:
            self._expire(now)
            seen = self._senders.get(sender)
            if seen is None:
                if len(self._senders) >= self.max_senders:
                    return None
                self._senders[sender] = _Seen(seq, 1, now)
                return True
            self._senders.move_to_end(sender)
            seen.last_at = now
            if seq > seen.newest:
                shift = seq - seen.newest
                seen.bits = ((seen.bits << shift) | 1) & ((1 << self.width) - 1)
                seen.newest = seq
                return True
            behind = seen.newest - seq
            if behind >= self.width or seen.bits >> behind & 1:
                return False
            seen.bits |= 1 << behind
            return True

    def _expire(self, now: float) -> None:
        while self._senders:
            sender, seen = next(iter(self._senders.items()))
            if now - seen.last_at <= self.idle_s:
                return
            del self._senders[sender]

    def size(self) -> int:
        return len(self._senders)


def is_auth_frame(frame: bytes) -> bool:
    return len(frame) == AUTH_FRAME_BYTES and frame.startswith(MAGIC)


def split(frames: Sequence[bytes]) -> tuple[list[bytes], bytes | None]:
    """The message's own frames and its auth frame (None: unsigned)."""
    if frames and is_auth_frame(frames[-1]):
        return list(frames[:-1]), frames[-1]
    return list(frames), None


UNSIGNED = "unsigned side-channel message"


def _refuse(reason: str, **fields: object) -> Decision:
    return Decision(GUARD, Verdict.REJECT, reason, None, dict(fields))


def verify(keyring: Keyring, frames: Sequence[bytes], auth: bytes | None, destination: str, window: ReplayWindow,
           *, max_age_s: float = DEFAULT_MAX_AGE_S, now: float | None = None) -> tuple[Decision, bytes | None]:
    """ALLOW (and the sender id) when ``auth`` signs ``frames`` for ``destination``, fresh and first used; REJECT
    with the reason otherwise (never quoting a MAC)."""
    if auth is None:
        return _refuse(UNSIGNED), None
    timestamp, seq = _HEAD.unpack_from(auth, len(MAGIC))
    sender = auth[len(MAGIC) + _HEAD.size:len(MAGIC) + _HEAD.size + SENDER_BYTES]
    presented = auth[-MAC_BYTES:]
    digest = frames_digest(frames)
    target = canonical_endpoint(destination)
    if not any(hmac.compare_digest(_mac(key, target, sender, timestamp, seq, digest), presented)
               for key in keyring.accepted):
        return _refuse("side-channel signature does not match (wrong secret, altered frames, or signed for another "
                       "rank port)"), None
    clock = time.time() if now is None else now
    age = clock - timestamp
    if abs(age) > max_age_s:
        return _refuse(f"side-channel message is {age:.0f} s old (accepted: within {max_age_s:.0f} s)",
                       sender=sender.hex()), None
    first = window.first_use(sender, seq, clock)
    if first is None:
        return _refuse("too many side-channel senders inside the validity window; cannot rule out a replay",
                       sender=sender.hex()), None
    if not first:
        return _refuse("side-channel message replayed (or far out of order)", sender=sender.hex()), None
    return allow(GUARD, sender=sender.hex()), sender
