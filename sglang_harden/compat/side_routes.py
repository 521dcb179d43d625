"""A prefill scheduler's own bootstrap server (:func:`bootstrap_base_url`) and the body of a side-channel PUT on it
(aiohttp): taken from this host only, bounded in size, parsed, then posted. Shared by the plugin
(``compat/bootstrap_routes.py``, the adapters) and the backport series' ``pd_digest`` (bundled into it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


async def accept_from_this_host(request: Any, what: str, limit: int, parse: Callable[[bytes], Any],
                                post: Callable[[Any], None], from_this_host: Callable[[Any], bool]) -> Any:
    """403 from another host, 413 over ``limit`` bytes, 400 on a malformed body, else ``post(parse(body))``. The
    body is read whole (aiohttp caps it at the app's client_max_size, 1 MiB by default) because the control-plane
    token check may have read it already."""
    from aiohttp import web

    if not from_this_host(request):
        return web.json_response({"error": f"{what} are accepted from this host only"}, status=403)
    body = await request.read()
    if len(body) > limit:
        return web.json_response({"error": f"{what}: body over {limit} bytes"}, status=413)
    try:
        item = parse(body)
    except ValueError as exc:
        return web.json_response({"error": str(exc)}, status=400)
    post(item)
    return web.json_response({"ok": True})


def bootstrap_base_url(scheduler: Any) -> str:
    """The URL a prefill scheduler process reaches its own bootstrap server at."""
    host = str(scheduler.server_args.host)
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    return f"http://{host}:{scheduler.disagg_prefill_bootstrap_queue.bootstrap_port}"
