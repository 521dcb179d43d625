"""Small pieces of the bootstrap server's HTTP handling that the plugin and the backport series share.

Standard library and aiohttp objects only: the backport series embed everything below the marker line in their
``pd_auth.py`` (``patches/_source/gen.py``; a unit test regenerates the series and fails on any drift).
"""

from __future__ import annotations

from typing import Any

# ---- embedded in the backport series from here on


async def answer_and_hang_up(request: Any, response: Any) -> Any:
    """Send ``response`` and close the connection at once (aiohttp would otherwise keep reading the unread body
    for its lingering time, 10 s, with the connection held open)."""
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    if request.transport is not None:
        request.transport.close()
    return response
