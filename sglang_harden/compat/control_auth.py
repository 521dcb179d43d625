"""Control-plane authentication inside SGLang's processes (the token rules: ``guards/bootstrap_auth.py``; the
secret file, signing and the answer check: ``control_keys.py``; the server's check: ``bootstrap_http.py``; all
three are what the backport series bundles too).

- Server: the bootstrap server's aiohttp app gets a middleware that checks the token of every request to every
  route (SGLang's ``/route``, ``/register_dp_rank``, ``/query_dp_ranks`` and the routes sglang-harden adds),
  except ``/health`` (liveness probes carry no secret and learn nothing), and signs the answers it serves.
- Clients: SGLang's bootstrap client code reaches the bootstrap server through the ``requests`` module that
  ``common/conn.py`` imported; that name is replaced by a proxy that signs every request it sends and checks the
  answers. Our own abort and digest clients sign and check through ``signing.CLIENT``.

The secret is read from the file named by ``SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE`` (``--harden-bootstrap-secret-
file``) and is never logged. Without it this module signs nothing and checks nothing: the control plane is
unauthenticated, which start-up says once, and the guard is not reported armed. Refusals (a request's token, an
answer's signature) are counted and logged as the guard's decisions and applied in its mode.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from sglang_harden import events
from sglang_harden.compat import bootstrap_http, signing
from sglang_harden.compat.control_keys import ControlKeys, SecretFile
from sglang_harden.compat.runtime import RUNTIME, HardenRefusal
from sglang_harden.compat.signing_client import SigningRequests
from sglang_harden.config import HardenConfig, Mode, bootstrap_auth_requested
from sglang_harden.guards import bootstrap_auth
from sglang_harden.guards.base import Decision

logger = logging.getLogger("sglang_harden")

def _report(decision: Decision, about: Mapping[str, object]) -> bool:
    return events.record(decision, RUNTIME.config.bootstrap_auth, **about)


_cache_lock = threading.Lock()
_cache: dict[tuple[object, ...], ControlKeys] = {}
_warned_unauthenticated = False


def load(config: HardenConfig) -> ControlKeys | None:
    """The process's authenticator for ``config`` (None: not configured or off). Raises HardenRefusal when a
    secret file is named but unusable (unreadable, not UTF-8, not valid), the listed authorities are not valid,
    or enforce was asked for without a secret file."""
    if config.bootstrap_auth is Mode.OFF:
        return None
    if not config.bootstrap_secret_file:
        if bootstrap_auth_requested():
            raise HardenRefusal("sglang-harden: --harden-bootstrap-auth enforce needs a secret: set "
                                "--harden-bootstrap-secret-file PATH (SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE)")
        return None
    key = (config.bootstrap_secret_file, config.bootstrap_auth_max_age_s, config.bootstrap_authorities,
           config.bootstrap_auth_accept_sgh1)
    with _cache_lock:
        if key not in _cache:
            _cache[key] = _read(config)
        return _cache[key]


def _read(config: HardenConfig) -> ControlKeys:
    try:
        listed = bootstrap_auth.parse_listed(config.bootstrap_authorities)
    except ValueError as exc:
        raise HardenRefusal(f"sglang-harden: --harden-bootstrap-authorities: {exc}") from None
    if config.bootstrap_auth_max_age_s <= 0:
        raise HardenRefusal("sglang-harden: --harden-bootstrap-auth-max-age-s must be > 0")
    try:
        secrets = SecretFile(config.bootstrap_secret_file)
    except bootstrap_auth.SecretFileError as exc:
        raise HardenRefusal(f"sglang-harden: {exc}") from None
    return ControlKeys(secrets, _report, max_age_s=float(config.bootstrap_auth_max_age_s),
                       accept_sgh1=config.bootstrap_auth_accept_sgh1, listed=listed)


def current() -> ControlKeys | None:
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


def outgoing_headers(method: str, authority: str, target: str, body: bytes | str | None) -> dict[str, str]:
    """The token header for one request of ours to the bootstrap server at ``authority`` ({} when not
    configured)."""
    return signing.SIGNER.headers(method, authority, target, body)


signing.register(current)  # what notify's and digest_channel's clients sign with


# ---------------------------------------------------------------- server side


def require_tokens(original: Any) -> Any:
    """Wrap ``<BootstrapServer>._setup_routes``: after the routes exist, every request passes the token check,
    for this server's identity (its host and port, the listed authorities)."""

    def setup_routes(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        identity = bootstrap_http.server_identity(getattr(self, "host", None), getattr(self, "port", None),
                                                  frozenset())
        self.app.middlewares.append(_token_middleware(identity))
        return result

    return setup_routes


def _token_middleware(identity: bootstrap_auth.ServerIdentity) -> Any:
    from aiohttp import web

    @web.middleware
    async def check_control_token(request: Any, handler: Any) -> Any:
        auth = current()
        if auth is None:
            return await handler(request)
        named = identity if identity.listed == auth.listed else dataclasses.replace(identity, listed=auth.listed)
        return await bootstrap_http.checked_request(auth, named, request, handler)

    return check_control_token


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
    module.requests = SigningRequests(requests, signing.SIGNER)  # type: ignore[attr-defined]


def signing_client_in_place(module: ModuleType | None) -> bool:
    return module is not None and bool(getattr(getattr(module, "requests", None), "signs_requests", False))
