"""The routes sglang-harden adds to prefill's bootstrap server, and their handlers.

``abort_routes`` serves the abort board (abort_notify's notices for decode), ``digest_routes`` the digest board
and feed (the checksum guard's, see :mod:`.digest_channel`). Side-channel PUTs are taken from this host only.
Shared by the 0.5.x and 0.4.9 family adapters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang_harden.channels import abort_wire
from sglang_harden.compat import digest_board, digest_channel, notify
from sglang_harden.compat.runtime import RUNTIME
from sglang_harden.compat.side_routes import accept_from_this_host
from sglang_harden.config import Mode

Func = Callable[..., Any]


def abort_routes(original: Func) -> Func:
    """``<BootstrapServer>._setup_routes``: the abort board (abort_notify's). On a tree whose backport series
    already serves ``/pd_rejections`` (same wire format), the patched routes stay and ours are not added."""
    return _with_routes(original, lambda: [("PUT", notify.ROUTE, handle_abort_put),
                                           ("GET", notify.ROUTE, handle_aborts_get)])


def digest_routes(original: Func) -> Func:
    """``<BootstrapServer>._setup_routes``: the digest board and feed (checksum's: decode reads a 404 there as
    "prefill is not hardened", so they must exist whenever the checksum guard is on, whatever abort_notify is)."""
    return _with_routes(original, lambda: [("PUT", digest_channel.DIGEST_PATH, handle_digest_put),
                                           ("GET", digest_channel.DIGESTS_PATH, handle_digests_get),
                                           ("GET", digest_channel.FEED_PATH, handle_digest_feed_get)])


def _with_routes(original: Func, routes: Callable[[], list[tuple[str, str, Any]]]) -> Func:
    def setup_routes(self: Any) -> Any:
        result = original(self)
        taken = _routes_served(self.app)
        for method, path, handler in routes():
            if (method, path) not in taken:
                self.app.router.add_route(method, path, handler)
        return result

    return setup_routes


def _routes_served(app: Any) -> set[tuple[str, str]]:
    served = set()
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        served.add((route.method, info.get("path") or info.get("formatter") or ""))
    return served


async def handle_abort_put(request: Any) -> Any:
    """Only the prefill node's own processes post aborts (same host); anyone else gets 403."""
    return await _accept_from_this_host(request, "aborts", abort_wire.MAX_NOTICE_BYTES,
                                        notify.parse_abort_body, notify.BOARD.post)


async def handle_digest_put(request: Any) -> Any:
    """Only the prefill node's own schedulers post digests (same host); anyone else gets 403."""
    return await _accept_from_this_host(request, "digests", 256 * 1024, digest_board.parse_digest_body,
                                        digest_board.post_and_signal)


async def _accept_from_this_host(request: Any, what: str, limit: int, parse: Callable[[bytes], Any],
                                 post: Callable[[Any], None]) -> Any:
    return await accept_from_this_host(request, what, limit, parse, post, abort_wire.request_from_this_host)


async def handle_digests_get(request: Any) -> Any:
    from aiohttp import web

    try:
        room = int(request.query.get("room", ""))
    except ValueError:
        return web.json_response({"error": "room must be an integer"}, status=400)
    publishing = RUNTIME.config.checksum is not Mode.OFF
    return web.json_response(digest_board.digests_payload(room, publishing))


async def handle_digest_feed_get(request: Any) -> Any:
    """Decode's feed reader: every digest posted after its cursor, answered as soon as there is one."""
    from aiohttp import web

    try:
        ask = digest_board.parse_feed_query(dict(request.query))
    except ValueError as exc:
        return web.json_response({"error": str(exc)}, status=400)
    if not digest_board.feed_has_news(ask) and ask.wait_s > 0:
        await digest_board.POSTED.wait(ask.wait_s)
    publishing = RUNTIME.config.checksum is not Mode.OFF
    return web.json_response(digest_board.feed_payload(ask, publishing))


async def handle_aborts_get(request: Any) -> Any:
    from aiohttp import web

    try:
        rooms = notify.parse_rooms_query(request.query.get("rooms", ""))
    except ValueError as exc:
        return web.json_response({"error": str(exc)}, status=400)
    return web.json_response(notify.aborts_payload(rooms))
