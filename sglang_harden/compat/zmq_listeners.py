"""Listeners that survive and peer sockets that stay bounded, for the ZMQ side channels of any KV manager (the
plugin's hooks in ``zmq_channels.py``; bundled into the backport series).

SGLang's listener loops are closures started with ``threading.Thread(target=...)`` in each backend's connection
module; an exception in one ends it and nothing starts it again (the node keeps running and never serves another
PD request). :class:`ThreadingWithRestarts` stands for ``threading`` in those modules and runs each listener loop
under :func:`restarting`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

logger = logging.getLogger("sglang_harden")

Func = Callable[..., Any]
# the listener loops each backend starts (closures inside the manager's start methods)
LISTENERS = frozenset({"bootstrap_thread", "bootstrap_thread_guarded", "decode_thread", "decode_listener_thread",
                       "bootstrap_worker", "decode_worker"})


def _ends_quietly(exc: BaseException) -> bool:
    """The socket or its context was closed: the listener's normal end at shutdown or a role switch."""
    import zmq

    return isinstance(exc, zmq.ZMQError) and exc.errno in (zmq.ETERM, zmq.ENOTSOCK)


def restarting(target: Func, name: str, on_restart: Callable[[str, BaseException], None]) -> Func:
    """Run ``target`` (a listener loop); when it raises, tell ``on_restart``, say so and run it again (backing off
    while it keeps failing at once). A closed socket or context ends it, as it ends the loop at shutdown."""

    def run(*args: Any, **kwargs: Any) -> Any:
        delay = 0.0
        while True:
            started = time.monotonic()
            try:
                return target(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - a listener that dies stops the node serving PD requests
                if _ends_quietly(exc):
                    return None
                on_restart(name, exc)
                logger.error("sglang-harden: side-channel listener %s raised %s: %s; started again", name,
                             type(exc).__name__, exc)
                delay = 0.0 if time.monotonic() - started > 10 else min(1.0, max(0.01, delay * 2))
                time.sleep(delay)

    run.__name__ = name
    return run


OnRestart = Callable[[str, BaseException], None]


class ThreadingWithRestarts:
    """Stands for the ``threading`` module inside a backend's connection module: a thread started on one of the
    listener loops runs it under :func:`restarting` while ``active()``; everything else is the real module."""

    def __init__(self, real: ModuleType, active: Callable[[], bool], on_restart: OnRestart) -> None:
        self._real = real
        self._active = active
        self._on_restart = on_restart

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def Thread(self, *args: Any, target: Func | None = None, **kwargs: Any) -> threading.Thread:  # noqa: N802
        name = getattr(target, "__name__", "")
        if target is not None and name in LISTENERS and self._active():
            target = restarting(target, name, self._on_restart)
        return self._real.Thread(*args, target=target, **kwargs)


def listeners_restart(module: ModuleType, active: Callable[[], bool], on_restart: OnRestart) -> None:
    """Install the restarting ``threading`` into a backend's connection module (its listener loops are closures,
    reachable only where their threads are made)."""
    if not isinstance(getattr(module, "threading", None), ThreadingWithRestarts):
        module.threading = ThreadingWithRestarts(threading, active, on_restart)  # type: ignore[attr-defined]


def listeners_restarting(module: ModuleType | None) -> bool:
    return module is not None and isinstance(getattr(module, "threading", None), ThreadingWithRestarts)


def cap_peer_sockets(manager: Any, keep: str, limit: int) -> None:
    """Close the manager's least recently connected idle sockets to peers past ``limit`` (never ``keep``, nor
    one a thread is sending on: that one goes on a later call)."""
    cache = getattr(manager, "_socket_cache", None)
    lock = getattr(manager, "_socket_lock", None)
    if not isinstance(cache, dict) or lock is None or len(cache) <= limit:
        return
    monitors = getattr(manager, "_monitor_cache", {})
    send_locks = getattr(manager, "_socket_send_locks", {})
    with lock:
        for endpoint in list(cache):
            if len(cache) <= limit:
                break
            send_lock = send_locks.get(endpoint)
            if endpoint == keep or (send_lock is not None and not send_lock.acquire(blocking=False)):
                continue  # in use: closed on a later pass
            try:
                cache.pop(endpoint).close(linger=0)
                monitor = monitors.pop(endpoint, None)
                if monitor is not None:
                    monitor.close(linger=0)
            finally:
                if send_lock is not None:
                    send_lock.release()
                    send_locks.pop(endpoint, None)
    logger.info("sglang-harden: closed peer sockets past %d on %s", limit, type(manager).__name__)




def trim_thread_sockets(cache: dict[str, Any], keep: str, limit: int) -> None:
    """One thread's own sockets to peers (MORI keeps a cache per thread, used by that thread alone, so no lock):
    past ``limit`` endpoints the oldest are closed, never ``keep``."""
    while len(cache) > limit:
        oldest = next((endpoint for endpoint in cache if endpoint != keep), None)
        if oldest is None:
            return
        cache.pop(oldest).close(linger=0)
