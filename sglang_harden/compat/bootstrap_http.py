"""The bootstrap server's side of control-plane authentication, for the plugin (``control_auth``) and the backport
series alike (``pd_auth`` bundles this module): the token check every request but ``/health`` passes, in the order
``guards/bootstrap_auth.py`` sets (nothing of the body is read before the token's MAC matched), and the signature
on each answer to an admitted request. Standard library and aiohttp objects only.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

from sglang_harden.compat.control_keys import ControlKeys
from sglang_harden.guards.bootstrap_auth import (
    ANSWER_HEADER,
    HEADER,
    OPEN_PATHS,
    RequestHead,
    ServerIdentity,
    canonical_host,
    check_body,
    check_head,
    sign_answer,
)

logger = logging.getLogger("sglang_harden")

# A control request's body arrives within this time or the request gets 408 (a stalled client must not hold a
# connection and its buffer open for ever).
BODY_READ_TIMEOUT_S = 10.0
# What SGLang's bootstrap handlers raise on a body of the wrong shape (missing keys, wrong types, bad JSON, numbers
# out of range: JSON's Infinity as a port is an OverflowError in int()): the sender's error (400), not ours.
MALFORMED = (KeyError, ValueError, TypeError, AttributeError, IndexError, ArithmeticError)
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})


def server_identity(bind_host: str | None, port: int | None, listed: frozenset[str]) -> ServerIdentity:
    """What the bootstrap server started on ``bind_host:port`` knows names it: that host (unless a wildcard), this
    machine's host name and FQDN; the operator's ``listed`` authorities; per connection, its local address."""
    names = [bind_host or "", socket.gethostname(), socket.getfqdn()]
    hosts = {canonical_host(name) for name in names if name not in WILDCARD_HOSTS}
    return ServerIdentity(int(port) if port is not None else None, frozenset(h for h in hosts if h), listed)


def _head(request: Any) -> RequestHead:
    hosts = request.headers.getall("Host", [])
    local = request.transport.get_extra_info("sockname") if request.transport is not None else None
    return RequestHead(request.method, hosts[0] if len(hosts) == 1 else None, request.raw_path,
                       local[0] if isinstance(local, tuple) and local else None)


async def answer_and_hang_up(request: Any, response: Any) -> Any:
    """Send ``response`` and close the connection at once (aiohttp would otherwise keep reading the unread body
    for its lingering time, 10 s, with the connection held open)."""
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    if request.transport is not None:
        request.transport.close()
    return response


async def _refused(request: Any, label: str, reason: str) -> Any:
    from aiohttp import web

    response = web.Response(status=401, text=f"{label}: {reason}\n")
    return await answer_and_hang_up(request, response) if request.body_exists else response


async def checked_request(keys: ControlKeys, identity: ServerIdentity, request: Any, handler: Any,
                          label: str = "sglang-harden") -> Any:
    """Serve ``request`` through ``handler`` if its token admits it (``keys.report`` says whether a refusal is
    applied: in log mode it is served anyway, unsigned); 401 otherwise, before the body is read where the token
    alone decides."""
    from aiohttp import web

    if request.path in OPEN_PATHS:
        return await handler(request)
    keyring, head = keys.refreshed(), _head(request)
    about = {"method": request.method, "path": request.path, "remote": request.remote}
    decision, token = check_head(keyring, head, request.headers.get(HEADER), keys.nonces, identity=identity,
                                 max_age_s=keys.max_age_s, accept_sgh1=keys.accept_sgh1)
    if not decision.allows and keys.report(decision, about):
        return await _refused(request, label, decision.reason)
    try:  # bounded in size by the app's client_max_size (larger bodies get 413) and here in time
        body = await asyncio.wait_for(request.read(), BODY_READ_TIMEOUT_S)
    except asyncio.TimeoutError:  # noqa: UP041 - a class of its own before Python 3.11 (the series' older pins)
        logger.warning("sglang-harden: %s %s from %s: body not received within %.0f s; refused", request.method,
                       request.path, request.remote, BODY_READ_TIMEOUT_S)
        return await answer_and_hang_up(request, web.Response(status=408, text=f"{label}: request body too slow\n"))
    if token is not None and decision.allows:
        decision = check_body(keyring, head, token, body, keys.nonces)
        if keys.report(decision, about):
            return web.Response(status=401, text=f"{label}: {decision.reason}\n")
    try:
        response = await handler(request)
    except MALFORMED as exc:  # a handler that trusted the body's shape
        logger.warning("sglang-harden: malformed %s %s from %s: %s", request.method, request.path, request.remote,
                       type(exc).__name__)
        return web.Response(status=400, text=f"{label}: malformed request ({type(exc).__name__})\n")
    answer = getattr(response, "body", None)
    if token is not None and decision.allows and isinstance(answer, (bytes, bytearray)) and not response.prepared:
        response.headers[ANSWER_HEADER] = sign_answer(keyring, token, response.status, bytes(answer))
    return response
