"""Authentication of the PD control plane (sglang-harden backport, not upstream SGLang code).

Whoever reaches prefill's bootstrap port can otherwise register as decode for a room (``PUT /route``), post or
read rejection notices (``/pd_rejections``) and query ranks. With a shared secret configured, every request to
every route of the bootstrap server except ``/health`` must carry a token, and every bootstrap client in this
process (SGLang's, through ``common/conn.py``'s ``requests``, and ``pd_rejections``) signs what it sends:

    X-SGLang-Harden-Auth: sgh1.<ts>.<nonce>.<mac>
    mac = hex HMAC-SHA256(secret, "sgh1\\n<METHOD>\\n<path?query as sent>\\n<hex sha256(body)>\\n<ts>\\n<nonce>")

The server accepts a token whose MAC matches under an accepted secret (compared in constant time), whose ``ts``
is within the validity window of its clock and whose nonce it has not seen in that window; anything else gets
401 (the log line never holds the token). This is the wire format of the sglang-harden plugin, so patched and
plugin nodes of one deployment interoperate.

Env (of every SGLang process of the deployment, prefill and decode):
  SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE     the signing secret on the first line, optionally one more accepted secret
                                          on the second (rotation: add the new one second everywhere, swap the
                                          lines everywhere, drop the old one); each at least 32 characters; the
                                          file is re-read when it changes
  SGLANG_HARDEN_BOOTSTRAP_AUTH            enforce (default with a secret file) | log (refusals logged, served) | off
  SGLANG_HARDEN_BOOTSTRAP_AUTH_MAX_AGE_S  token validity in seconds (default 60)
No secret file: nothing is signed or checked and a WARNING says the control plane is unauthenticated.
``enforce`` asked for without a secret file, or an unusable secret file: importing this module raises
``ConfigurationError`` (the server refuses to start).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import secrets
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from types import ModuleType
from typing import Any, Dict, Optional, Tuple

logger = logging.getLogger(__name__)

HEADER = "X-SGLang-Harden-Auth"
VERSION = "sgh1"
ENV_SECRET_FILE = "SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE"
ENV_MODE = "SGLANG_HARDEN_BOOTSTRAP_AUTH"
ENV_MAX_AGE = "SGLANG_HARDEN_BOOTSTRAP_AUTH_MAX_AGE_S"
MODES = ("enforce", "log", "off")
OPEN_PATHS = frozenset({"/health"})
MIN_SECRET_CHARS = 32
MAX_SECRETS = 2
NONCE_CHARS = 32
MAX_TOKEN_CHARS = 256
MAX_NONCES = 200_000
RELOAD_EVERY_S = 1.0
BODY_READ_TIMEOUT_S = 10.0
# What a bootstrap handler raises on a body of the wrong shape: the sender's error (400), not the server's (500).
MALFORMED = (KeyError, ValueError, TypeError, AttributeError, IndexError, ArithmeticError)


class ConfigurationError(RuntimeError):
    """The authentication settings cannot be used (the message never contains a secret)."""


def parse_secrets(text: str) -> Tuple[bytes, ...]:
    """The accepted secrets, signing secret first (blank lines and ``#`` comments ignored)."""
    found = [line.strip() for line in text.splitlines()]
    found = [line for line in found if line and not line.startswith("#")]
    if not found:
        raise ConfigurationError("the bootstrap secret file holds no secret")
    if len(found) > MAX_SECRETS:
        raise ConfigurationError(f"the bootstrap secret file holds {len(found)} secrets; at most {MAX_SECRETS}")
    for number, secret in enumerate(found, start=1):
        if len(secret) < MIN_SECRET_CHARS:
            raise ConfigurationError(f"secret {number} in the bootstrap secret file is {len(secret)} characters; "
                                     f"at least {MIN_SECRET_CHARS} (e.g. `openssl rand -hex 32`)")
    return tuple(secret.encode() for secret in found)


def _body_digest(body: Any) -> str:
    data = body.encode() if isinstance(body, str) else (body or b"")
    return hashlib.sha256(data).hexdigest()


def _mac(key: bytes, method: str, target: str, digest: str, timestamp: int, nonce: str) -> str:
    message = f"{VERSION}\n{method.upper()}\n{target}\n{digest}\n{timestamp}\n{nonce}".encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


class _Nonces:
    """Nonces seen inside the validity window. Full of unexpired ones: the caller refuses (forgetting one early
    would let its token be replayed)."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._seen: "OrderedDict[str, float]" = OrderedDict()
        self._lock = threading.Lock()

    def first_use(self, nonce: str, now: float) -> Optional[bool]:
        with self._lock:
            while self._seen and next(iter(self._seen.values())) <= now:
                self._seen.popitem(last=False)
            if nonce in self._seen:
                return False
            if len(self._seen) >= MAX_NONCES:
                return None
            self._seen[nonce] = now + self._window_s
            return True


class Authenticator:
    """The secrets of this process (re-read when the file changes) and its replay cache."""

    def __init__(self, path: str, mode: str, max_age_s: float) -> None:
        self.path, self.mode, self.max_age_s = path, mode, max_age_s
        self._stamp = self._file_stamp()
        self._secrets = parse_secrets(self._read())
        self._checked_at = time.monotonic()
        self._nonces = _Nonces(2 * max_age_s + 5)
        if os.stat(path).st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning("pd_auth: the bootstrap secret file %s is readable by group or others; chmod 600 it", path)

    def _read(self) -> str:
        try:
            with open(self.path, encoding="utf-8") as handle:
                return handle.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigurationError(f"cannot read the bootstrap secret file {self.path}: {exc}") from None

    def _file_stamp(self) -> Tuple[int, int]:
        info = os.stat(self.path)
        return info.st_mtime_ns, info.st_size

    def accepted(self) -> Tuple[bytes, ...]:
        """The secrets, re-read at most once a second when the file changed. A file that became unreadable or
        invalid keeps the last good secrets (and says so): authentication never switches itself off."""
        now = time.monotonic()
        if now - self._checked_at >= RELOAD_EVERY_S:
            self._checked_at = now
            try:
                stamp = self._file_stamp()
                if stamp != self._stamp:
                    self._secrets, self._stamp = parse_secrets(self._read()), stamp
                    logger.warning("pd_auth: bootstrap secret file %s re-read (%d secret(s) accepted)", self.path,
                                   len(self._secrets))
            except (OSError, ConfigurationError) as exc:
                logger.error("pd_auth: bootstrap secret file %s unusable (%s); keeping the last good secrets",
                             self.path, exc)
        return self._secrets

    def token(self, method: str, target: str, body: Any) -> str:
        timestamp, nonce = int(time.time()), secrets.token_hex(NONCE_CHARS // 2)
        mac = _mac(self.accepted()[0], method, target, _body_digest(body), timestamp, nonce)
        return f"{VERSION}.{timestamp}.{nonce}.{mac}"

    def refusal(self, method: str, target: str, body: bytes, token: Optional[str]) -> Optional[str]:
        """None when the request may be served, else why not (never quoting the token)."""
        if not token:
            return "missing control-plane token"
        parts = token.split(".")
        if (len(token) > MAX_TOKEN_CHARS or len(parts) != 4 or parts[0] != VERSION or not parts[1].isdigit()
                or len(parts[2]) != NONCE_CHARS or len(parts[3]) != 64):
            return "malformed control-plane token"
        timestamp, nonce, presented = int(parts[1]), parts[2], parts[3].encode()
        digest = _body_digest(body)
        if not any(hmac.compare_digest(_mac(key, method, target, digest, timestamp, nonce).encode(), presented)
                   for key in self.accepted()):
            return "control-plane token does not match (wrong secret, or method, path, query or body changed)"
        now = time.time()
        if abs(now - timestamp) > self.max_age_s:
            return f"control-plane token is {now - timestamp:.0f} s old (accepted: within {self.max_age_s:.0f} s)"
        first = self._nonces.first_use(nonce, now)
        if first is None:
            return "too many control-plane requests inside the replay window; cannot rule out a replay"
        return None if first else "control-plane token replayed"


def _load() -> Optional[Authenticator]:
    mode = os.environ.get(ENV_MODE, "").strip().lower()
    path = os.environ.get(ENV_SECRET_FILE, "").strip()
    if mode and mode not in MODES:
        raise ConfigurationError(f"{ENV_MODE}={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "off":
        logger.warning("pd_auth: %s=off: the PD control plane is UNAUTHENTICATED", ENV_MODE)
        return None
    if not path:
        if mode == "enforce":
            raise ConfigurationError(f"{ENV_MODE}=enforce needs a secret: set {ENV_SECRET_FILE} to a file")
        logger.warning("pd_auth: the PD control plane is UNAUTHENTICATED (no %s): anyone who reaches the "
                       "bootstrap port can register routes and post or read rejection notices", ENV_SECRET_FILE)
        return None
    try:
        max_age_s = float(os.environ.get(ENV_MAX_AGE, "60"))
    except ValueError:
        raise ConfigurationError(f"{ENV_MAX_AGE} must be a number of seconds") from None
    if not max_age_s > 0:
        raise ConfigurationError(f"{ENV_MAX_AGE} must be > 0")
    if not os.path.isfile(path):
        raise ConfigurationError(f"the bootstrap secret file {path} does not exist")
    authenticator = Authenticator(path, mode or "enforce", max_age_s)
    logger.info("pd_auth: PD control plane authenticated (%s mode, %d secret(s))", authenticator.mode,
                len(authenticator.accepted()))
    return authenticator


AUTH = _load()


def headers(method: str, target: str, body: Any) -> Dict[str, str]:
    """The token header for one request to a bootstrap server ({} when not configured)."""
    return {HEADER: AUTH.token(method, target, body)} if AUTH is not None else {}


# ------------------------------------------------------------------ server side


def protect(app: Any) -> None:
    """Every request to the bootstrap server's ``app`` (except ``/health``) passes the token check."""
    from aiohttp import web

    if AUTH is not None:
        app.middlewares.append(web.middleware(_check_token))


async def _check_token(request: Any, handler: Any) -> Any:
    from aiohttp import web

    if request.path in OPEN_PATHS:
        return await handler(request)
    try:  # the app's client_max_size bounds the size (413), this the time
        body = await asyncio.wait_for(request.read(), BODY_READ_TIMEOUT_S)
    except asyncio.TimeoutError:
        logger.warning("pd_auth: %s %s from %s: body not received within %.0f s; refused", request.method,
                       request.path, request.remote, BODY_READ_TIMEOUT_S)
        return await answer_and_hang_up(request, web.Response(status=408, text="request body too slow\n"))
    reason = AUTH.refusal(request.method, request.raw_path, body, request.headers.get(HEADER))
    if reason is not None:
        logger.warning("pd_auth: %s %s %s from %s: %s", "refused" if AUTH.mode == "enforce" else "would refuse",
                       request.method, request.path, request.remote, reason)
        if AUTH.mode == "enforce":
            return web.Response(status=401, text=f"pd_auth: {reason}\n")
    try:
        return await handler(request)
    except MALFORMED as exc:
        logger.warning("pd_auth: malformed %s %s from %s: %s", request.method, request.path, request.remote,
                       type(exc).__name__)
        return web.Response(status=400, text=f"malformed request ({type(exc).__name__})\n")


# <embed sglang_harden/compat/bootstrap_http.py>


# ------------------------------------------------------------------ client side


# <embed sglang_harden/compat/signing_client.py>


def signing(requests_module: ModuleType) -> ModuleType:
    """``requests`` itself when the control plane is unauthenticated, else a signing proxy of it."""
    return SigningRequests(requests_module, headers) if AUTH is not None else requests_module
