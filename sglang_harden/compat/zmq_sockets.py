"""The two socket classes of the PD side channels: a rank port that admits a message only after the checks, and a
peer socket that signs what it sends. SGLang's own sockets are switched to them (``sock.__class__``), so they
stay real ``zmq.Socket`` objects (``zmq.Poller`` takes them) and SGLang's code runs unchanged around them.

What a rank port admits (:class:`Inbox`): with a secret, the message's auth frame is verified and removed
(``guards/zmq_auth.py``), then the wire rules of its backend and role say whether SGLang's listener may read it
(``backends/wire_rules.py``). A refused message is counted (``sglang_harden_guard_decisions_total``), logged at
most once per ``LOG_EVERY_S`` per reason with the count since, and dropped; the listener waits for the next one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq

from sglang_harden import events
from sglang_harden.compat.zmq_settings import auth_state, side_mode
from sglang_harden.config import Mode
from sglang_harden.guards import zmq_auth
from sglang_harden.guards.base import Decision, Verdict

logger = logging.getLogger("sglang_harden")

SIDE_GUARD = "side_channels"
LOG_EVERY_S = 10.0


class Rules(Protocol):
    def problem(self, frames: list[bytes], sender: bytes | None) -> str | None: ...

    def kind(self, frames: list[bytes]) -> str: ...


SIGNER = zmq_auth.Signer()


def as_bytes(part: Any) -> bytes:
    if isinstance(part, bytes):
        return part
    if isinstance(part, zmq.Frame):
        return part.bytes
    return memoryview(part).tobytes()


@dataclass
class _Summary:
    count: int = 0
    logged_at: float = float("-inf")


@dataclass
class Inbox:
    """One rank port's admission: ``endpoint`` as its peers address it, ``label`` for logs (role, backend)."""

    endpoint: str
    label: str
    rules: Rules | None = None
    window: zmq_auth.ReplayWindow = field(default_factory=lambda: zmq_auth.ReplayWindow(2 * 60.0 + 5))
    _summaries: dict[str, _Summary] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def admit(self, frames: Sequence[bytes]) -> list[bytes] | None:
        """The frames SGLang's listener may read (the auth frame removed), or None: dropped."""
        own, auth = zmq_auth.split(frames)
        sender = None
        state = auth_state()
        if state is not None and state.mode is not Mode.OFF:
            self.window.idle_s = 2 * state.max_age_s + 5
            decision, sender = zmq_auth.verify(state.keyring, own, auth, self.endpoint, self.window,
                                               max_age_s=state.max_age_s)
            if not decision.allows and self._refused(decision, state.mode, own):
                return None
        mode = side_mode()
        if self.rules is not None and mode is not Mode.OFF:
            reason = self.rules.problem(own, sender)
            if reason is not None:
                decision = Decision(SIDE_GUARD, Verdict.REJECT, reason)
                if self._refused(decision, mode, own):
                    return None
        return own

    def _refused(self, decision: Decision, mode: Mode, frames: list[bytes]) -> bool:
        kind = self._kind(frames)
        applied = events.record(decision, mode, quiet=True, port=self.endpoint, kind=kind)
        self._summarise(decision, kind, applied)
        return applied

    def _kind(self, frames: list[bytes]) -> str:
        try:
            return self.rules.kind(frames) if self.rules is not None else "message"
        except Exception:  # noqa: BLE001 - naming the message must never be the reason it is lost
            return "unknown"

    def _summarise(self, decision: Decision, kind: str, applied: bool) -> None:
        key = f"{decision.guard}: {decision.reason} ({kind})"
        now = time.monotonic()
        with self._lock:
            summary = self._summaries.setdefault(key, _Summary())
            summary.count += 1
            if now - summary.logged_at < LOG_EVERY_S:
                return
            count, summary.count, summary.logged_at = summary.count, 0, now
        logger.warning("sglang-harden: %s %s %d side-channel message(s) on %s %s: %s",
                       decision.guard, "dropped" if applied else "let through (log mode)", count, self.label,
                       self.endpoint, key.partition(": ")[2])


class VerifyingSocket(zmq.Socket):
    """A rank port (PULL): ``recv_multipart`` returns the next admitted message; a message the inbox refuses is
    never returned. Where the caller polls before each receive (``returns_none``), a refusal with nothing more
    queued returns None (the caller's "nothing yet") instead of blocking past its timeout. ``recv`` (a reader of
    one-frame messages: the PP consensus store) returns the admitted message's first frame, as bytes."""

    _sgh_inbox: Inbox | None = None
    _sgh_returns_none: bool = False

    def _frames(self, flags: int, track: bool) -> list[bytes]:
        # zmq.Socket.recv by name: pyzmq's own recv_multipart calls self.recv, which this class overrides
        parts = [zmq.Socket.recv(self, flags, copy=True, track=track)]
        while self.getsockopt(zmq.RCVMORE):
            parts.append(zmq.Socket.recv(self, flags, copy=True, track=track))
        return parts

    def recv_multipart(self, flags: int = 0, copy: bool = True, track: bool = False) -> Any:
        while True:
            frames = self._frames(flags, track)
            inbox = self._sgh_inbox
            admitted = inbox.admit(frames) if inbox is not None else frames
            if admitted is not None:
                return admitted
            if flags & zmq.NOBLOCK:
                raise zmq.Again()
            if self._sgh_returns_none and not self.poll(0):
                return None

    def recv(self, flags: int = 0, copy: bool = True, track: bool = False) -> Any:
        admitted = self.recv_multipart(flags, copy=copy, track=track)
        return admitted if admitted is None else (admitted[0] if admitted else b"")


class SigningSocket(zmq.Socket):
    """A socket to a peer's rank port (PUSH): what it sends carries the auth frame for ``_sgh_destination``
    while signing is on; a one-frame ``send`` (the PP consensus store's) too."""

    _sgh_destination: str = ""
    _sgh_multipart = False  # send_multipart under way: pyzmq sends each of its parts through self.send
    _sgh_partial = False  # a caller's part sent with SNDMORE: the message's last part goes out as it is

    def _auth(self, parts: list[bytes]) -> bytes | None:
        state = auth_state()
        if state is not None and state.sign and state.mode is not Mode.OFF and self._sgh_destination:
            return SIGNER.sign(state.keyring, parts, self._sgh_destination)
        return None

    def send_multipart(self, msg_parts: Sequence[Any], flags: int = 0, copy: bool = True, track: bool = False,
                       **kwargs: Any) -> Any:
        auth = self._auth([as_bytes(part) for part in msg_parts])
        if auth is not None:
            msg_parts = [*(as_bytes(part) for part in msg_parts), auth]
        self._sgh_multipart = True
        try:
            return super().send_multipart(msg_parts, flags=flags, copy=copy, track=track, **kwargs)
        finally:
            self._sgh_multipart = False

    def send(self, data: Any, flags: int = 0, copy: bool = True, track: bool = False, **kwargs: Any) -> Any:
        if self._sgh_multipart or flags & zmq.SNDMORE or self._sgh_partial:
            self._sgh_partial = bool(flags & zmq.SNDMORE) and not self._sgh_multipart
            return super().send(data, flags, copy=copy, track=track, **kwargs)
        frame = as_bytes(data)
        auth = self._auth([frame])
        if auth is None:
            return super().send(data, flags, copy=copy, track=track, **kwargs)
        super().send(frame, flags | zmq.SNDMORE, copy=copy, track=track)
        return super().send(auth, flags, copy=copy, track=track)


def make_verifying(sock: Any, inbox: Inbox) -> None:
    if not isinstance(sock, VerifyingSocket):
        sock.__class__ = VerifyingSocket
    sock._sgh_inbox = inbox


def make_signing(sock: Any, destination: str) -> None:
    if not isinstance(sock, SigningSocket):
        sock.__class__ = SigningSocket
    sock._sgh_destination = destination
