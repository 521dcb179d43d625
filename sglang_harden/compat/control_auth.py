"""Control-plane authentication inside SGLang's processes (the token rules: ``guards/bootstrap_auth.py``).

- Server: the bootstrap server's aiohttp app gets a middleware that checks the token of every request to every
  route (SGLang's ``/route``, ``/register_dp_rank``, ``/query_dp_ranks`` and the routes sglang-harden adds),
  except ``/health`` (liveness probes carry no secret and learn nothing).
- Clients: SGLang's bootstrap client code reaches the bootstrap server through the ``requests`` module that
  ``common/conn.py`` imported; that name is replaced by a proxy that signs every request it sends. Our own
  abort and digest clients sign through :func:`outgoing_headers`.

The secret is read from the file named by ``SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE`` (``--harden-bootstrap-secret-
file``) and is never logged. Without it this module signs nothing and checks nothing: the control plane is
unauthenticated, which start-up says once, and the guard is not reported armed.
"""

from __future__ import annotations

import asyncio
import logging
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from sglang_harden import events
from sglang_harden.compat import signing
from sglang_harden.compat.bootstrap_http import answer_and_hang_up
from sglang_harden.compat.runtime import RUNTIME, HardenRefusal
from sglang_harden.compat.signing_client import SigningRequests
from sglang_harden.config import HardenConfig, Mode, bootstrap_auth_requested
from sglang_harden.guards import bootstrap_auth
from sglang_harden.guards.base import Decision

logger = logging.getLogger("sglang_harden")

OPEN_PATHS = frozenset({"/health"})
RELOAD_EVERY_S = 1.0


@dataclass
class ControlAuth:
    """The secret file's keyring (re-read when the file changes: rotation without a restart) and the replay
    cache of this process."""

    path: Path
    keyring: bootstrap_auth.Keyring
    nonces: bootstrap_auth.NonceCache
    max_age_s: float
    stamp: tuple[int, int] = (0, 0)
    checked_at: float = 0.0

    def headers(self, method: str, target: str, body: bytes | str | None) -> dict[str, str]:
        return {bootstrap_auth.HEADER: bootstrap_auth.sign(self.refreshed(), method, target, body)}

    def check(self, method: str, target: str, body: bytes, token: str | None) -> Decision:
        return bootstrap_auth.verify(self.refreshed(), method, target, body, token, self.nonces,
                                     max_age_s=self.max_age_s)

    def refreshed(self) -> bootstrap_auth.Keyring:
        """The keyring, re-read at most once a second when the file's size or mtime changed. A file that became
        unreadable or invalid keeps the last good keyring (and says so): authentication never switches off."""
        now = time.monotonic()
        if now - self.checked_at < RELOAD_EVERY_S:
            return self.keyring
        self.checked_at = now
        try:
            stamp = _stamp(self.path)
            if stamp != self.stamp:
                self.keyring, self.stamp = bootstrap_auth.parse_secrets(self.path.read_text()), stamp
                logger.warning("sglang-harden: bootstrap secret file %s re-read (%d secret(s) accepted)", self.path,
                               len(self.keyring.accepted))
        except (OSError, bootstrap_auth.SecretFileError) as exc:
            logger.error("sglang-harden: bootstrap secret file %s unusable (%s); keeping the last good secrets",
                         self.path, exc)
        return self.keyring


def _stamp(path: Path) -> tuple[int, int]:
    info = path.stat()
    return info.st_mtime_ns, info.st_size


_cache_lock = threading.Lock()
_cache: dict[tuple[str, int], ControlAuth] = {}
_warned_unauthenticated = False


def load(config: HardenConfig) -> ControlAuth | None:
    """The process's authenticator for ``config`` (None: not configured or off). Raises HardenRefusal when a
    secret file is named but unusable, or enforce was asked for without one."""
    if config.bootstrap_auth is Mode.OFF:
        return None
    if not config.bootstrap_secret_file:
        if bootstrap_auth_requested():
            raise HardenRefusal("sglang-harden: --harden-bootstrap-auth enforce needs a secret: set "
                                "--harden-bootstrap-secret-file PATH (SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE)")
        return None
    key = (config.bootstrap_secret_file, config.bootstrap_auth_max_age_s)
    with _cache_lock:
        if key not in _cache:
            _cache[key] = _read(Path(config.bootstrap_secret_file), float(config.bootstrap_auth_max_age_s))
        return _cache[key]


def _read(path: Path, max_age_s: float) -> ControlAuth:
    try:
        text = path.read_text()
        info = path.stat()
    except OSError as exc:
        raise HardenRefusal(f"sglang-harden: cannot read the bootstrap secret file {path}: "
                            f"{exc.strerror or exc}") from None
    try:
        keyring = bootstrap_auth.parse_secrets(text)
    except bootstrap_auth.SecretFileError as exc:
        raise HardenRefusal(f"sglang-harden: {path}: {exc}") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("sglang-harden: the bootstrap secret file %s is readable by group or others (mode %o); "
                       "chmod 600 it", path, stat.S_IMODE(info.st_mode))
    return ControlAuth(path, keyring, bootstrap_auth.NonceCache(2 * max_age_s + 5), max_age_s,
                       (info.st_mtime_ns, info.st_size), time.monotonic())


def current() -> ControlAuth | None:
    return load(RUNTIME.config)


def configured() -> bool:
    """A secret file is configured and the guard is not off (the guard's hooks are registered only then)."""
    return RUNTIME.config.bootstrap_auth is not Mode.OFF and bool(RUNTIME.config.bootstrap_secret_file)


def status() -> str:
    """What ``/server_info`` and the operator tools show: enforce, log, or unauthenticated."""
    return RUNTIME.config.bootstrap_auth.value if configured() else "unauthenticated"


def warn_if_unauthenticated(role: str) -> None:
    """Once per process on a PD node: say that anyone who reaches the bootstrap port is trusted."""
    global _warned_unauthenticated
    if role not in ("prefill", "decode") or configured() or _warned_unauthenticated:
        return
    _warned_unauthenticated = True
    logger.warning("sglang-harden: the PD control plane is UNAUTHENTICATED (no --harden-bootstrap-secret-file): "
                   "anyone who reaches the bootstrap port can register routes, post abort notices and read "
                   "digests")


def outgoing_headers(method: str, target: str, body: bytes | str | None) -> dict[str, str]:
    """The token header for one request of ours to a bootstrap server ({} when not configured)."""
    auth = current()
    return auth.headers(method, target, body) if auth is not None else {}


signing.register(outgoing_headers)  # what notify's and digest_channel's clients sign with


# ---------------------------------------------------------------- server side


def require_tokens(original: Any) -> Any:
    """Wrap ``<BootstrapServer>._setup_routes``: after the routes exist, every request passes the token check."""

    def setup_routes(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        self.app.middlewares.append(_token_middleware())
        return result

    return setup_routes


def _token_middleware() -> Any:
    from aiohttp import web

    @web.middleware
    async def check_control_token(request: Any, handler: Any) -> Any:
        auth = current()
        if auth is None or request.path in OPEN_PATHS:
            return await handler(request)
        try:  # bounded in size by the app's client_max_size (larger bodies get 413) and here in time
            body = await asyncio.wait_for(request.read(), BODY_READ_TIMEOUT_S)
        except TimeoutError:
            logger.warning("sglang-harden: %s %s from %s: body not received within %.0f s; refused",
                           request.method, request.path, request.remote, BODY_READ_TIMEOUT_S)
            return await answer_and_hang_up(request, web.Response(status=408, text="sglang-harden: request body "
                                                                   "too slow\n"))
        decision = auth.check(request.method, request.raw_path, body, request.headers.get(bootstrap_auth.HEADER))
        if events.record(decision, RUNTIME.config.bootstrap_auth, method=request.method, path=request.path,
                         remote=request.remote):
            return web.Response(status=401, text=f"sglang-harden: {decision.reason}\n")
        try:
            return await handler(request)
        except MALFORMED as exc:  # a handler that trusted the body's shape: the sender's error, not ours
            logger.warning("sglang-harden: malformed %s %s from %s: %s", request.method, request.path,
                           request.remote, type(exc).__name__)
            return web.Response(status=400, text=f"sglang-harden: malformed request ({type(exc).__name__})\n")

    return check_control_token


# A control request's body arrives within this time or the request gets 408 (a stalled client must not hold a
# connection and its buffer open for ever).
BODY_READ_TIMEOUT_S = 10.0

# What SGLang's bootstrap handlers raise on a body of the wrong shape (missing keys, wrong types, bad JSON, numbers
# out of range: JSON's Infinity as a port is an OverflowError in int()).
MALFORMED = (KeyError, ValueError, TypeError, AttributeError, IndexError, ArithmeticError)


# ---------------------------------------------------------------- client side (SGLang's bootstrap client)


def install_signing_client(module: ModuleType) -> None:
    """Replace the ``requests`` name of SGLang's bootstrap client module by a proxy that signs (only while a
    secret is configured: the proxy asks at each request)."""
    import requests

    found = getattr(module, "requests", None)
    if getattr(found, "signs_requests", False):
        return
    if found is not requests:
        from sglang_harden.compat.hooks import HookInstallError

        raise HookInstallError(f"{module.__name__}.requests: expected the requests module, found {found!r} "
                               "(is this SGLang pin supported? see `sglang-harden doctor`)")
    module.requests = SigningRequests(requests, outgoing_headers)  # type: ignore[attr-defined]


def signing_client_in_place(module: ModuleType | None) -> bool:
    return module is not None and bool(getattr(getattr(module, "requests", None), "signs_requests", False))
