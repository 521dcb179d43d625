"""Authenticated, checked and surviving ZMQ side channels of PD disaggregation (sglang-harden backport, not upstream
SGLang code).

Every KV manager (prefill and decode; Mooncake, NIXL, MORI) binds one PULL socket, its rank port, on its
network-facing address. Decode registers there where prefill writes a request's KV and sends each room's transfer
info and abort notices; prefill sends statuses, aux data and drain acks to decode's. Upstream trusts every frame that
reaches it: a forged registration redirects another tenant's KV, a one-frame message ends the listener thread (the
node serves no PD request again), a forged AUX_DATA index makes decode write anywhere in its memory.

- ``guard_rank_port`` (``CommonKVManager.__init__``, right after the bind): the rank port admits a message only
  after the checks (the socket's class is switched; it stays a real ``zmq.Socket``): with the control-plane secret,
  its last frame must be the auth frame ``sghz1 | ts | seq | sender | mac`` (HMAC-SHA256 under the secret of the
  destination rank port, the sender's instance id, ``ts``, ``seq`` and every other frame), fresh and not replayed;
  the frame is removed before SGLang reads the message. Then the wire rules of the manager's backend and role say
  whether the listener may read it (its shape, and who may say what). A refused message is counted, logged at most
  every few seconds per reason, and dropped; the listener waits for the next one.
- ``sign_socket`` (``CommonKVManager._connect``, ``CommonKVReceiver._connect``, ``MoriKVManager._connect_threadsafe``,
  the staging prefetch socket): every socket SGLang connects to a peer's rank port appends the auth frame.
- ``guard_pp_store`` / ``sign_socket`` (0.5.22+, ``PPConsensusStore._init_zmq``): PP rank 0's status store, bound on
  the same network-facing address, admits only signed messages; the other PP ranks' sockets sign.
- ``returns_none_when_polled`` (``_make_worker_recv``'s poll branch, role switching): a refused message with
  nothing behind it reads as "nothing yet", so the loop still sees its stop flag.
- ``restarting_listener`` (each backend's listener ``threading.Thread(target=...)``): a listener loop that raises
  is started again, instead of leaving the node deaf.
- ``cap_sockets`` (``_send_multipart_locked``): past ``MAX_PEER_SOCKETS`` peer endpoints (an abort notice names any
  address it likes) the least recently connected idle sockets are closed; ``cap_thread_sockets`` (MORI's
  ``_connect_threadsafe``, a cache per thread) closes a thread's oldest.

The auth frame, the replay window, the sockets, the restarts and the wire rules are sglang-harden's own code
(``guards/zmq_auth.py``, ``compat/zmq_sockets.py``, ``compat/zmq_listeners.py``, ``compat/backends/wire_rules.py``),
put in below when the series is generated: one wire format, so patched and plugin nodes of a deployment speak to
each other. The secret is the control-plane patch's (``pd_auth``: same file, same rotation, same validity window).

Env (every SGLang process of the deployment):
  SGLANG_HARDEN_ZMQ_AUTH        enforce (default with a secret) | log (refusals counted and logged, served) | off;
                                enforce without a usable secret refuses to start
  SGLANG_HARDEN_ZMQ_SIGN        1 (default) | 0: sign nothing (the first step of a rollout: a frame an unpatched
                                peer does not expect breaks its parser, so a fleet moves ZMQ_AUTH=log ZMQ_SIGN=0
                                -> log, 1 -> enforce, 1)
  SGLANG_HARDEN_SIDE_CHANNELS   enforce (default, secret or not) | log | off: the wire rules, listener restarts and
                                the socket cap
Any other value refuses to start.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from dataclasses import dataclass
from enum import Enum
from typing import Any, Optional, Tuple

from sglang.srt.disaggregation.common import pd_auth

logger = logging.getLogger(__name__)

AUTH_ENV = "SGLANG_HARDEN_ZMQ_AUTH"
SIGN_ENV = "SGLANG_HARDEN_ZMQ_SIGN"
SIDE_ENV = "SGLANG_HARDEN_SIDE_CHANNELS"
MAX_PEER_SOCKETS = 1024
BACKEND_BY_CLASS = {"MooncakeKVManager": "mooncake", "NixlKVManager": "nixl", "MoriKVManager": "mori"}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

# <prelude>


class Mode(StrEnum):
    ENFORCE = "enforce"
    LOG = "log"
    OFF = "off"


@dataclass(frozen=True)
class Keyring:
    """The control-plane secrets (``pd_auth``): the signing one first, every accepted one."""

    signing: bytes
    accepted: Tuple[bytes, ...]

    def __repr__(self) -> str:  # never print a secret
        return f"Keyring(<{len(self.accepted)} secret(s)>)"


class _Events:
    """sglang-harden's ``events`` here: every decision counted (``COUNTS``, by guard and verdict; ``*_logged`` in log
    mode); the caller logs its own rate-limited summary."""

    def __init__(self) -> None:
        self.counts: "collections.Counter[Tuple[str, str]]" = collections.Counter()
        self._lock = threading.Lock()

    def record(self, decision: Any, mode: Mode, *, quiet: bool = False, **context: object) -> bool:
        """Count ``decision``; True when the caller must apply it (enforce)."""
        if mode is Mode.OFF:
            return False
        applied = mode is Mode.ENFORCE
        verdict = decision.verdict.value
        with self._lock:
            self.counts[(decision.guard, verdict if applied or decision.allows else f"{verdict}_logged")] += 1
        if not quiet and not decision.allows:
            logger.warning("pd_side_channels: %s %s: %s %s", decision.guard, verdict, decision.reason, context)
        return applied and not decision.allows


events = _Events()
COUNTS = events.counts


def _auth_mode() -> Mode:
    raw = os.environ.get(AUTH_ENV, "").strip().lower()
    if raw and raw not in MODES:
        raise ValueError(f"{AUTH_ENV}={raw!r}: expected one of {', '.join(MODES)}")
    if pd_auth.AUTH is None:
        if raw == Mode.ENFORCE.value:
            raise pd_auth.ConfigurationError(f"{AUTH_ENV}=enforce needs the control-plane secret: set "
                                             f"{pd_auth.ENV_SECRET_FILE} (and leave {pd_auth.ENV_MODE} on)")
        return Mode.OFF
    return Mode(raw or series_rollout_mode() or Mode.ENFORCE.value)


def _sign_from_env() -> bool:
    raw = os.environ.get(SIGN_ENV, "").strip().lower() or "1"
    if raw not in _TRUE + _FALSE:
        raise ValueError(f"{SIGN_ENV}={raw!r}: expected 1 or 0")
    return raw in _TRUE


AUTH_MODE = _auth_mode()
SIGN = _sign_from_env()
SIDE_MODE = Mode(mode_from_env(SIDE_ENV))


@dataclass(frozen=True)
class AuthState:
    """The keyring (re-read when the secret file changes), the mode, whether to sign, the messages' validity."""

    keyring: Keyring
    mode: Mode
    sign: bool
    max_age_s: float


_STATE: Optional[AuthState] = None


def auth_state() -> Optional[AuthState]:
    """sglang-harden's ``zmq_settings.auth_state`` here: None without a secret (or with ZMQ auth off)."""
    global _STATE
    auth = pd_auth.AUTH
    if auth is None or AUTH_MODE is Mode.OFF:
        return None
    accepted = auth.accepted()  # re-reads the file at most once a second when it changed
    state = _STATE
    if state is None or state.keyring.accepted is not accepted:
        state = _STATE = AuthState(Keyring(accepted[0], accepted), AUTH_MODE, SIGN, auth.max_age_s)
    return state


def side_mode() -> Mode:
    return SIDE_MODE


# <bundle sglang_harden/guards/base.py sglang_harden/guards/zmq_auth.py sglang_harden/compat/zmq_sockets.py sglang_harden/compat/zmq_listeners.py sglang_harden/compat/backends/wire_rules.py>


# ---- the backport's own glue: SGLang's sockets in, the plugin's classes on them


def _role(manager: Any) -> str:
    mode = getattr(manager, "disaggregation_mode", None)
    return str(getattr(mode, "value", mode) or "unknown").lower()


def _backend(manager: Any) -> str:
    for cls in type(manager).__mro__:
        if cls.__name__ in BACKEND_BY_CLASS:
            return BACKEND_BY_CLASS[cls.__name__]
    return "unknown"


def _wire_rules(manager: Any, backend: str, role: str) -> Any:
    try:
        return WireRules(backend, role, manager)
    except ValueError as exc:  # a backend or role the rules do not know: the MAC is still checked
        logger.warning("pd_side_channels: no wire rules for this KV manager (%s)", exc)
        return None


def guard_rank_port(manager: Any, wire_rules: bool = True) -> None:
    """The manager's rank port (``server_socket``, just bound, no listener yet) admits through an ``Inbox``.
    ``wire_rules`` False (releases before 0.5.18, whose messages the rules do not describe): the auth frame only."""
    sock = getattr(manager, "server_socket", None)
    if sock is None or (AUTH_MODE is Mode.OFF and SIDE_MODE is Mode.OFF):
        return
    backend, role = _backend(manager), _role(manager)
    endpoint = canonical_endpoint(f"{manager.local_ip}:{manager.rank_port}")
    rules = _wire_rules(manager, backend, role) if wire_rules else None
    make_verifying(sock, Inbox(endpoint, f"{role} {backend}", rules))
    # said here, not only at import: releases import this module before their processes configure logging
    logger.log(logging.WARNING if AUTH_MODE is Mode.OFF else logging.INFO,
               "pd_side_channels: %s %s rank port %s: ZMQ auth %s, wire rules %s", role, backend, endpoint, status(),
               SIDE_MODE.value if wire_rules else "none on this release")


def guard_pp_store(sock: Any, host: str, port: int) -> None:
    """PP rank 0's consensus-store socket (just bound, no worker yet) admits only signed messages (with a secret);
    SGLang's own decoder judges their contents."""
    if AUTH_MODE is not Mode.OFF:
        make_verifying(sock, Inbox(canonical_endpoint(f"{host}:{port}"), "prefill pp-consensus"))


def returns_none_when_polled(sock: Any) -> None:
    """The listener polls with a timeout before each receive: a refusal with nothing queued reads as None."""
    if isinstance(sock, VerifyingSocket):
        sock._sgh_returns_none = True


def sign_socket(sock: Any, endpoint: str) -> None:
    """A socket SGLang just connected to a peer's rank port ``endpoint`` signs what it sends (with a secret)."""
    if auth_state() is not None:
        make_signing(sock, endpoint)


def cap_sockets(manager: Any, endpoint: str) -> None:
    if SIDE_MODE is not Mode.OFF:
        cap_peer_sockets(manager, endpoint, MAX_PEER_SOCKETS)


def cap_thread_sockets(cache: dict, endpoint: str) -> None:
    """MORI's sockets to peers, one cache per thread: capped like the manager's."""
    if SIDE_MODE is not Mode.OFF:
        trim_thread_sockets(cache, endpoint, MAX_PEER_SOCKETS)


def _restarted(name: str, exc: BaseException) -> None:
    events.record(Decision("side_channels", Verdict.SKIP, f"listener {name} raised {type(exc).__name__}; started "
                           "again"), Mode.ENFORCE, quiet=True)


def restarting_listener(target: Any) -> Any:
    """A listener loop that raises is run again (while the side-channel checks are on)."""
    if SIDE_MODE is Mode.OFF:
        return target
    return restarting(target, getattr(target, "__name__", "listener"), _restarted)


def status() -> str:
    """enforce / log / log (not signing) / unauthenticated."""
    if AUTH_MODE is Mode.OFF:
        return "unauthenticated"
    return AUTH_MODE.value if SIGN else f"{AUTH_MODE.value} (not signing)"


if AUTH_MODE is Mode.OFF:
    logger.warning("pd_side_channels: the PD ZMQ side channels are UNAUTHENTICATED (no control-plane secret, or %s="
                   "off): anyone who reaches a rank port can register as decode, forge statuses and abort rooms",
                   AUTH_ENV)
