"""What the ZMQ side channels need of the configuration right now (no pyzmq here: operator tools read it too)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang_harden.compat import control_auth
from sglang_harden.compat.runtime import RUNTIME
from sglang_harden.config import Mode


@dataclass(frozen=True)
class AuthState:
    """The keyring (re-read when the secret file changes), the mode, whether to sign, the messages' validity."""

    keyring: Any  # guards.bootstrap_auth.Keyring
    mode: Mode
    sign: bool
    max_age_s: float


def auth_configured() -> bool:
    """A secret file is configured and ``zmq_auth`` is not off (its hooks are registered only then)."""
    return RUNTIME.config.zmq_auth is not Mode.OFF and control_auth.configured()


def auth_state() -> AuthState | None:
    auth = control_auth.current() if auth_configured() else None
    if auth is None:
        return None
    return AuthState(auth.refreshed(), RUNTIME.config.zmq_auth, RUNTIME.config.zmq_sign, auth.max_age_s)


def side_mode() -> Mode:
    return RUNTIME.config.side_channels


def status() -> str:
    """What ``/server_info`` and the operator tools show for the ZMQ channels' authentication."""
    if not auth_configured():
        return "unauthenticated"
    mode = RUNTIME.config.zmq_auth.value
    return mode if RUNTIME.config.zmq_sign else f"{mode} (not signing)"
