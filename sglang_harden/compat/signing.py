"""The token header of our own control-plane requests, and the one side-channel HTTP client that sends them
(``CLIENT``, used by ``notify`` and ``digest_channel``). ``control_auth`` registers its signer here when it is
imported (``compat/__init__`` always imports it), so the clients depend on this leaf and not on ``control_auth``
(which depends on them through ``runtime``). Nothing registered: requests go unsigned, and an authenticated server
refuses them (closed)."""

from __future__ import annotations

from collections.abc import Callable

from sglang_harden.channels.http_client import SideChannelClient

Signer = Callable[[str, str, "bytes | str | None"], dict[str, str]]
_signer: Signer | None = None


def register(signer: Signer) -> None:
    global _signer
    _signer = signer


def headers(method: str, target: str, body: bytes | str | None) -> dict[str, str]:
    """The token header for one request to a bootstrap server ({} when no secret is configured)."""
    return _signer(method, target, body) if _signer is not None else {}


# Kept-alive connections per (thread, address), every request signed; shared by the abort-notice and digest clients.
CLIENT = SideChannelClient(headers)
