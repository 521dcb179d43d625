"""Bootstrap authentication: only a holder of the cluster's shared secret can register a bootstrap route.

Invariant: a ``PUT /route`` (or any bootstrap registration) for room R from host:port is accepted only with a
token ``v1.<timestamp>.<hex>`` whose HMAC-SHA256 over (room, host, port, timestamp) under the shared secret
matches (compared in constant time) and whose timestamp is at most ``max_age_s`` old (and not from the future
beyond the same skew). Missing, malformed, forged or expired tokens are refused with 401.
"""

from __future__ import annotations

import hashlib
import hmac
import time

from sglang_harden.guards.base import Decision, Verdict, allow

GUARD = "bootstrap_auth"
_VERSION = "v1"


def _mac(secret: str, room: int, host: str, port: int, timestamp: int) -> str:
    if not secret:
        raise ValueError("bootstrap_auth needs a non-empty shared secret")
    message = f"{_VERSION}\n{room}\n{host}\n{port}\n{timestamp}".encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def sign(secret: str, room: int, host: str, port: int, timestamp: int | None = None) -> str:
    """A token proving the caller knows ``secret``, bound to this room, host, port and time."""
    ts = int(time.time()) if timestamp is None else int(timestamp)
    return f"{_VERSION}.{ts}.{_mac(secret, room, host, port, ts)}"


def _refuse(reason: str, room: int) -> Decision:
    return Decision(GUARD, Verdict.REJECT, reason, 401, {"room": room})


def verify(
    secret: str,
    room: int,
    host: str,
    port: int,
    token: str | None,
    max_age_s: float,
    now: float | None = None,
) -> Decision:
    """ALLOW a registration carrying a valid, fresh token; REJECT 401 otherwise."""
    if not secret:
        return _refuse("bootstrap authentication has no shared secret configured", room)
    if not token:
        return _refuse("missing bootstrap token", room)
    parts = token.split(".")
    if len(parts) != 3 or parts[0] != _VERSION or not parts[1].isdigit():
        return _refuse("malformed bootstrap token", room)
    timestamp = int(parts[1])
    expected = _mac(secret, room, host, port, timestamp)
    if not hmac.compare_digest(expected.encode(), parts[2].encode()):
        return _refuse("bootstrap token does not match (wrong secret, room, host or port)", room)
    age = (time.time() if now is None else now) - timestamp
    if abs(age) > max_age_s:
        return _refuse(f"bootstrap token is {age:.0f}s old (max {max_age_s:.0f}s)", room)
    return allow(GUARD, room=room)
