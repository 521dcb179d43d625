"""The signer of our own control-plane requests, and the one side-channel HTTP client that sends them (``CLIENT``,
used by ``notify`` and ``digest_channel``). ``control_auth`` registers where the process's keys come from when it is
imported (``compat/__init__`` always imports it), so the clients depend on this leaf and not on ``control_auth``
(which depends on them through ``runtime``). Nothing registered: requests go unsigned, and an authenticated server
refuses them (closed)."""

from __future__ import annotations

from collections.abc import Callable

from sglang_harden.channels.http_client import SideChannelClient
from sglang_harden.compat.control_keys import ControlKeys, CurrentSigner

_source: Callable[[], ControlKeys | None] | None = None


def register(source: Callable[[], ControlKeys | None]) -> None:
    global _source
    _source = source


def keys() -> ControlKeys | None:
    """This process's control-plane keys (None: no secret configured, or nothing registered yet)."""
    return _source() if _source is not None else None


SIGNER = CurrentSigner(keys)
# Kept-alive connections per (thread, address), every request signed and its answer checked; shared by the
# abort-notice and digest clients.
CLIENT = SideChannelClient(SIGNER)
