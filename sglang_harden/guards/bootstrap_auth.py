"""Control-plane authentication: only holders of the PD deployment's shared secret may use its control routes.

Invariant: a request to a protected control route (SGLang's bootstrap routes and the routes sglang-harden adds
to the bootstrap server) is served only when it carries a token ``sgh1.<ts>.<nonce>.<mac>`` where ``mac`` is
HMAC-SHA256, under one of the accepted secrets, of the method, the request target (path and query, as sent),
the SHA-256 of the body, ``ts`` and ``nonce``; ``ts`` is within ``max_age_s`` of the verifier's clock; and
``nonce`` was not seen inside the window in which that token is valid. The MAC is compared in constant time.
Anything else is refused with 401. The room is bound through the body or the query, where the route has one.

Rotation: the secret file holds the signing secret first and at most one more accepted secret (the next one, or
the previous one), so a fleet rotates without downtime: add the new secret second everywhere, swap the order
everywhere, then drop the old one.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from sglang_harden.guards.base import Decision, Verdict, allow

GUARD = "bootstrap_auth"
HEADER = "X-SGLang-Harden-Auth"
VERSION = "sgh1"
MIN_SECRET_CHARS = 32
MAX_SECRETS = 2
DEFAULT_MAX_AGE_S = 60.0
NONCE_CHARS = 32
MAX_TOKEN_CHARS = 256


class SecretFileError(ValueError):
    """The secret file cannot be used (the message never contains a secret)."""


@dataclass(frozen=True)
class Keyring:
    """The secret new tokens are signed with, and every secret a token may be signed with (signing first)."""

    signing: bytes
    accepted: tuple[bytes, ...]

    def __repr__(self) -> str:  # never print a secret
        return f"Keyring(<{len(self.accepted)} secret(s)>)"


def parse_secrets(text: str) -> Keyring:
    """One secret per line (blank lines and ``#`` comments ignored): the signing one, then an optional second."""
    found = [line.strip() for line in text.splitlines()]
    found = [line for line in found if line and not line.startswith("#")]
    if not found:
        raise SecretFileError("the bootstrap secret file holds no secret")
    if len(found) > MAX_SECRETS:
        raise SecretFileError(f"the bootstrap secret file holds {len(found)} secrets; at most {MAX_SECRETS} "
                              "(the signing secret, then one more accepted during a rotation)")
    for number, secret in enumerate(found, start=1):
        if len(secret) < MIN_SECRET_CHARS:
            raise SecretFileError(f"secret {number} in the bootstrap secret file is {len(secret)} characters; "
                                  f"at least {MIN_SECRET_CHARS} (e.g. `openssl rand -hex 32`)")
    keys = tuple(secret.encode() for secret in found)
    return Keyring(keys[0], keys)


def body_digest(body: bytes | str | None) -> str:
    data = body.encode() if isinstance(body, str) else (body or b"")
    return hashlib.sha256(data).hexdigest()


def _mac(key: bytes, method: str, target: str, digest: str, timestamp: int, nonce: str) -> str:
    message = f"{VERSION}\n{method.upper()}\n{target}\n{digest}\n{timestamp}\n{nonce}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def sign(keyring: Keyring, method: str, target: str, body: bytes | str | None, *, now: float | None = None,
         nonce: str | None = None) -> str:
    """A token for one request: ``target`` is the path with its query string exactly as sent."""
    timestamp = int(time.time() if now is None else now)
    nonce = nonce or secrets.token_hex(NONCE_CHARS // 2)
    return f"{VERSION}.{timestamp}.{nonce}.{_mac(keyring.signing, method, target, body_digest(body), timestamp, nonce)}"


class NonceCache:
    """Nonces seen inside the validity window, bounded. Full of unexpired nonces: refuse (never forget one early,
    which would let its token be replayed)."""

    def __init__(self, window_s: float, max_entries: int = 200_000) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> when it may be forgotten
        self._lock = threading.Lock()

    def first_use(self, nonce: str, now: float) -> bool | None:
        """True: first use (now remembered); False: a replay; None: the cache is full, cannot decide."""
        with self._lock:
            self._expire(now)
            if nonce in self._seen:
                return False
            if len(self._seen) >= self.max_entries:
                return None
            self._seen[nonce] = now + self.window_s
            return True

    def _expire(self, now: float) -> None:
        while self._seen:
            nonce, forget_at = next(iter(self._seen.items()))
            if forget_at > now:
                return
            del self._seen[nonce]

    def size(self) -> int:
        return len(self._seen)


def _refuse(reason: str, **fields: object) -> Decision:
    return Decision(GUARD, Verdict.REJECT, reason, 401, dict(fields))


def verify(keyring: Keyring, method: str, target: str, body: bytes | str | None, token: str | None,
           nonces: NonceCache, *, max_age_s: float = DEFAULT_MAX_AGE_S, now: float | None = None) -> Decision:
    """ALLOW a request whose token is valid, fresh and unused; REJECT 401 otherwise (the reason never quotes the
    token)."""
    if not token:
        return _refuse("missing control-plane token")
    if len(token) > MAX_TOKEN_CHARS:
        return _refuse("malformed control-plane token")
    parts = token.split(".")
    if (len(parts) != 4 or parts[0] != VERSION or not parts[1].isdigit() or len(parts[2]) != NONCE_CHARS
            or len(parts[3]) != 64):
        return _refuse("malformed control-plane token")
    timestamp, nonce, presented = int(parts[1]), parts[2], parts[3].encode()
    digest = body_digest(body)
    if not any(hmac.compare_digest(_mac(key, method, target, digest, timestamp, nonce).encode(), presented)
               for key in keyring.accepted):
        return _refuse("control-plane token does not match (wrong secret, or method, path, query or body "
                       "changed)")
    clock = time.time() if now is None else now
    age = clock - timestamp
    if abs(age) > max_age_s:
        return _refuse(f"control-plane token is {age:.0f} s old (accepted: within {max_age_s:.0f} s)")
    first = nonces.first_use(nonce, clock)
    if first is None:
        return _refuse("too many control-plane requests inside the replay window; cannot rule out a replay")
    if not first:
        return _refuse("control-plane token replayed")
    return allow(GUARD)
