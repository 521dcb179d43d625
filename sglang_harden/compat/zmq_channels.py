"""The ZMQ side channels of PD disaggregation, hooked: decode registers on prefill's rank port where prefill writes
a request's KV and sends each room's transfer info and abort notices; prefill sends statuses, aux data and drain
acks to decode's. Every KV manager binds one such port (a PULL socket, one listener thread) on its network-facing
address, and every frame that reaches it was trusted until now.

- ``zmq_auth`` (armed with the control-plane secret): every socket SGLang connects to a peer's rank port signs
  what it sends (the manager's, the receivers', MORI's and staging's prefetch sockets); every rank port verifies
  and strips the auth frame (``guards/zmq_auth.py``). Modes: ``enforce`` drops what is not signed by a holder;
  ``log`` counts and serves it; with ``--harden-zmq-sign 0`` nothing is signed (the first step of a rollout,
  when peers may not understand the frame yet).
- The PP consensus store (0.5.22+, prefill with ``--pp-size`` > 1): PP rank 0 binds a PULL socket on the same
  network-facing address, where the other PP ranks replicate each room's status; it verifies like a rank port (no
  wire rules: SGLang's own decoder drops what it cannot read) and the other ranks' sockets sign.
- ``side_channels`` (on by default, secret or not): the rank port admits only what its backend's listener can
  read and what the sender may say (``backends/wire_rules.py``); a listener thread that raises anyway is started
  again; the manager's sockets to peers are capped (least recently connected closed first), and so are MORI's per
  thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import ModuleType
from typing import Any

from sglang_harden import events
from sglang_harden.compat.hooks import Hook
from sglang_harden.compat.internals import CONN, MORI, PP_CONSENSUS, STAGING_HANDLER
from sglang_harden.compat.runtime import RUNTIME
from sglang_harden.compat.zmq_listeners import cap_peer_sockets, trim_thread_sockets
from sglang_harden.compat.zmq_listeners import listeners_restart as install_restarts
from sglang_harden.config import Mode
from sglang_harden.guards.base import Decision, Verdict
from sglang_harden.guards.zmq_auth import canonical_endpoint

logger = logging.getLogger("sglang_harden")

Func = Callable[..., Any]
AUTH = "zmq_auth"
SIDE = "side_channels"
MAX_PEER_SOCKETS = 1024
BACKEND_BY_CLASS = {"MooncakeKVManager": "mooncake", "NixlKVManager": "nixl", "MoriKVManager": "mori"}


# ---------------------------------------------------------------- the rank port


def _role(manager: Any) -> str:
    mode = getattr(manager, "disaggregation_mode", None)
    return str(getattr(mode, "value", mode) or "unknown").lower()


def _backend(manager: Any) -> str:
    for cls in type(manager).__mro__:
        if cls.__name__ in BACKEND_BY_CLASS:
            return BACKEND_BY_CLASS[cls.__name__]
    return "unknown"


def _rules(manager: Any, backend: str, role: str) -> Any:
    from sglang_harden.compat.backends.wire_rules import WireRules

    return WireRules(backend, role, manager)


def guard_rank_port(original: Func) -> Func:
    """Wrap ``CommonKVManager.__init__``: once the rank port is bound (before any listener starts), it admits
    messages through an :class:`Inbox`."""

    def init(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        from sglang_harden.compat.zmq_sockets import Inbox, make_verifying

        sock = getattr(self, "server_socket", None)
        if sock is not None and not isinstance(getattr(sock, "_sgh_inbox", None), Inbox):
            backend, role = _backend(self), _role(self)
            endpoint = canonical_endpoint(f"{self.local_ip}:{self.rank_port}")
            make_verifying(sock, Inbox(endpoint, f"{role} {backend}", _rules(self, backend, role)))
        return result

    return init


def returns_none_when_polled(original: Func) -> Func:
    """Wrap ``CommonKVManager._make_worker_recv`` (0.5.21+): where the listener polls with a timeout before each
    receive (role switching), a refused message with nothing behind it reads as "nothing yet", so the loop still
    sees its stop flag; where it blocks, the rank port waits for the next admitted message."""

    def make_worker_recv(self: Any, socket: Any, *args: Any, **kwargs: Any) -> Any:
        recv = original(self, socket, *args, **kwargs)
        blocking = recv == getattr(socket, "recv_multipart", None) or getattr(self, "deferred_bootstrap", None)
        if not blocking and hasattr(socket, "_sgh_returns_none"):
            socket._sgh_returns_none = True
        return recv

    return make_worker_recv


# ---------------------------------------------------------------- the sockets to peers


def sign_manager_socket(original: Func) -> Func:
    """Wrap ``CommonKVManager._connect`` (the manager's socket per peer endpoint): it signs."""

    def connect(self: Any, endpoint: str, *args: Any, **kwargs: Any) -> Any:
        from sglang_harden.compat.zmq_sockets import make_signing

        sock = original(self, endpoint, *args, **kwargs)
        make_signing(sock, endpoint)
        return sock

    return connect


def cap_manager_sockets(original: Func) -> Func:
    """Wrap ``CommonKVManager._connect``: past ``MAX_PEER_SOCKETS`` peer endpoints (an abort notice names any
    address it likes), the least recently connected idle sockets are closed."""

    def connect(self: Any, endpoint: str, *args: Any, **kwargs: Any) -> Any:
        sock = original(self, endpoint, *args, **kwargs)
        cap_peer_sockets(self, endpoint, MAX_PEER_SOCKETS)
        return sock

    return connect


def cap_thread_sockets(original: Func) -> Func:
    """Wrap ``MoriKVManager._connect_threadsafe`` (MORI's socket per peer endpoint, a cache per thread): past
    ``MAX_PEER_SOCKETS`` endpoints in the calling thread's cache, its oldest sockets are closed."""

    def connect(self: Any, endpoint: str, *args: Any, **kwargs: Any) -> Any:
        sock = original(self, endpoint, *args, **kwargs)
        cache = getattr(getattr(self, "_socket_local", None), "socket_cache", None)
        if isinstance(cache, dict):
            trim_thread_sockets(cache, endpoint, MAX_PEER_SOCKETS)
        return sock

    return connect


def sign_receiver_socket(original: Func) -> Func:
    """Wrap ``CommonKVReceiver._connect`` (decode's socket per prefill rank port, shared by its receivers)."""

    def connect(cls: Any, endpoint: str, *args: Any, **kwargs: Any) -> Any:
        from sglang_harden.compat.zmq_sockets import make_signing

        found = original(cls, endpoint, *args, **kwargs)
        make_signing(found[0] if isinstance(found, tuple) else found, endpoint)
        return found

    return connect


def sign_thread_socket(original: Func) -> Func:
    """Wrap ``MoriKVManager._connect_threadsafe`` (MORI's socket per peer endpoint and thread)."""

    def connect(self: Any, endpoint: str, *args: Any, **kwargs: Any) -> Any:
        from sglang_harden.compat.zmq_sockets import make_signing

        sock = original(self, endpoint, *args, **kwargs)
        make_signing(sock, endpoint)
        return sock

    return connect


def _bound_endpoint(sock: Any) -> str:
    import zmq

    raw = sock.getsockopt(zmq.LAST_ENDPOINT)
    return raw.decode() if isinstance(raw, bytes) else str(raw)


def guard_pp_store(original: Func) -> Func:
    """Wrap ``PPConsensusStore._init_zmq`` (before the store's worker thread starts): PP rank 0's socket admits only
    signed messages, the other ranks' sockets sign (the destination is the endpoint they connected to)."""

    def init_zmq(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        from sglang_harden.compat.zmq_sockets import Inbox, make_signing, make_verifying

        sock = getattr(self, "_socket", None)
        if sock is None:
            return result
        endpoint = _bound_endpoint(sock)
        if getattr(self, "_pp_rank", 0) == 0:
            make_verifying(sock, Inbox(canonical_endpoint(endpoint), "prefill pp-consensus"))
        else:
            make_signing(sock, endpoint)
        return result

    return init_zmq


class _SigningSockets(dict):
    """Staging's prefetch sockets for one call: a socket signs from the moment SGLang files it under its
    endpoint, before its first send."""

    def __setitem__(self, endpoint: str, sock: Any) -> None:
        from sglang_harden.compat.zmq_sockets import make_signing

        make_signing(sock, endpoint)
        super().__setitem__(endpoint, sock)


def sign_staging_sockets(original: Func) -> Func:
    """Wrap the staging handler's ``prefetch_staging_reqs`` (prefill's STAGING_REQ to decode's rank port, sent on
    sockets it opens itself): the sockets it opens sign."""

    def prefetch(room: Any, transfer_infos: Any, kv_buffer_tensors: Any, chunked_prefill_size: Any,
                 staging_requested: Any, prefetch_sockets: dict, *args: Any, **kwargs: Any) -> Any:
        signing = _SigningSockets(prefetch_sockets)
        try:
            return original(room, transfer_infos, kv_buffer_tensors, chunked_prefill_size, staging_requested,
                            signing, *args, **kwargs)
        finally:
            for endpoint, sock in signing.items():
                prefetch_sockets.setdefault(endpoint, sock)

    return prefetch


def _restarted(name: str, exc: BaseException) -> None:
    events.record(Decision(SIDE, Verdict.SKIP, f"listener {name} raised {type(exc).__name__}; started again"),
                  Mode.ENFORCE, quiet=True)


def listeners_restart(module: ModuleType) -> None:
    """A backend's connection module imported: its listener loops will be started again when they raise (while
    the side_channels guard is on)."""
    install_restarts(module, lambda: RUNTIME.config.side_channels is not Mode.OFF, _restarted)


# ---------------------------------------------------------------- the table

MANAGER_INIT = (CONN, "CommonKVManager.__init__")
INIT_PARAMS = ("self", "args", "disaggregation_mode", "server_args")
STAGING_PARAMS = ("room", "transfer_infos", "kv_buffer_tensors", "chunked_prefill_size", "staging_requested",
                  "prefetch_sockets")
HOOKS: list[Hook] = [
    Hook(SIDE, *MANAGER_INIT, INIT_PARAMS, guard_rank_port),
    Hook(AUTH, *MANAGER_INIT, INIT_PARAMS, guard_rank_port),
    Hook(SIDE, CONN, "CommonKVManager._make_worker_recv", ("self", "socket"), returns_none_when_polled,
         optional=True),
    Hook(AUTH, CONN, "CommonKVManager._make_worker_recv", ("self", "socket"), returns_none_when_polled,
         optional=True),
    Hook(SIDE, CONN, "CommonKVManager._connect", ("self", "endpoint"), cap_manager_sockets),
    Hook(AUTH, CONN, "CommonKVManager._connect", ("self", "endpoint"), sign_manager_socket),
    Hook(AUTH, CONN, "CommonKVReceiver._connect", ("cls", "endpoint"), sign_receiver_socket),
    Hook(AUTH, MORI, "MoriKVManager._connect_threadsafe", ("self", "endpoint"), sign_thread_socket),
    Hook(SIDE, MORI, "MoriKVManager._connect_threadsafe", ("self", "endpoint"), cap_thread_sockets),
    Hook(AUTH, STAGING_HANDLER, "prefetch_staging_reqs", STAGING_PARAMS, sign_staging_sockets, optional=True),
    Hook(AUTH, PP_CONSENSUS, "PPConsensusStore._init_zmq", ("self",), guard_pp_store, optional=True),
]
