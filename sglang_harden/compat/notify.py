"""The abort side channel: prefill tells decode, through prefill's bootstrap server, that a room is dead.

Upstream has no prefill->decode abort message for a room that never sent KV (a rejected request never gets
a sender), so decode waits for its waiting timeout holding pages. The notices use the wire format of
``channels/abort_wire.py`` (``/pd_rejections``), the same as the backport series', so a patched prefill
notifies a plugin decode and the reverse.

Decode polls from a background thread and marks a hit room failed in its own KV manager, so the request
leaves through SGLang's normal transfer-failure path on every TP rank alike (ranks all-reduce their polls).
This module knows no SGLang names: the family adapter passes the callbacks that touch SGLang objects.
"""

from __future__ import annotations

import http.client
import json
import logging
import queue
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable

from sglang_harden.channels import abort_wire
from sglang_harden.channels.abort_wire import (  # noqa: F401 - this module's public names
    BOARD_CAPACITY,
    MAX_ROOMS_PER_QUERY,
    AbortBoard,
    PeerAbort,
    is_same_host,
    parse_rooms_query,
)
from sglang_harden.compat import signing

logger = logging.getLogger("sglang_harden")

ROUTE = abort_wire.ROUTE
POLL_INTERVAL_S = 0.2
HTTP_TIMEOUT_S = 2.0

BOARD = AbortBoard()


def parse_abort_body(body: bytes) -> PeerAbort:
    """Validate a PUT body; raise ValueError with a short reason on anything malformed."""
    return abort_wire.parse_notice(body)


def aborts_payload(rooms: list[int], board: AbortBoard | None = None) -> dict[str, object]:
    return abort_wire.board_answer(board or BOARD, rooms)


class Publisher:
    """Posts aborts to the local bootstrap server from a background thread (never blocks a scheduler)."""

    def __init__(self, base_url: str) -> None:
        self._base_url = base_url.rstrip("/")
        self._addr = urllib.parse.urlsplit(self._base_url).netloc
        self._queue: queue.Queue[PeerAbort] = queue.Queue(maxsize=BOARD_CAPACITY)
        threading.Thread(target=self._run, name="sglang-harden-abort-publisher", daemon=True).start()

    def publish(self, abort: PeerAbort) -> None:
        BOARD.post(abort)  # same-process readers (a tokenizer-side rejection) see it at once
        try:
            self._queue.put_nowait(abort)
        except queue.Full:
            logger.error("sglang-harden: abort publisher queue full; room %s not published", abort.room)

    def _run(self) -> None:
        while True:
            abort = self._queue.get()
            self._post_with_retries(abort)

    def _post_with_retries(self, abort: PeerAbort) -> None:
        status, failure = signing.CLIENT.request_until("PUT", self._addr, ROUTE, HTTP_TIMEOUT_S,
                                                       abort_wire.notice_body(abort), attempts=5, pause_s=0.2)
        if status != 200:
            logger.error("sglang-harden: gave up publishing abort of room %s to %s (last: %s)", abort.room,
                         self._base_url, failure or f"HTTP {status}")


OnPeerAbort = Callable[[object, PeerAbort], None]


class DecodeWatcher:
    """Tracks rooms decode waits on, asks their prefill bootstrap servers about aborts, reports hits."""

    def __init__(self, on_abort: OnPeerAbort, concluded: Callable[[object], bool] | None = None,
                 name: str = "sglang-harden-abort-watcher") -> None:
        self._on_abort = on_abort
        self._concluded = concluded or _concluded
        self._lock = threading.Lock()
        self._waiting: dict[str, dict[int, weakref.ref[object]]] = {}
        self._hits: dict[int, PeerAbort] = {}
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def watch(self, bootstrap_addr: str, room: int, receiver: object) -> None:
        with self._lock:
            self._waiting.setdefault(bootstrap_addr, {})[room] = weakref.ref(receiver)

    def forget(self, room: int) -> None:
        with self._lock:
            for rooms in self._waiting.values():
                rooms.pop(room, None)

    def hit(self, room: int | None) -> PeerAbort | None:
        if room is None:
            return None
        with self._lock:
            return self._hits.get(room)

    def _snapshot(self) -> dict[str, list[tuple[int, object]]]:
        live: dict[str, list[tuple[int, object]]] = {}
        with self._lock:
            for addr, rooms in self._waiting.items():
                for room, ref in list(rooms.items()):
                    receiver = ref()
                    if receiver is None or self._concluded(receiver):
                        del rooms[room]
                    else:
                        live.setdefault(addr, []).append((room, receiver))
        return live

    def _run(self) -> None:
        while True:
            time.sleep(POLL_INTERVAL_S)
            for addr, entries in self._snapshot().items():
                try:
                    self._poll_addr(addr, entries)
                except Exception:  # noqa: BLE001 - a dead watcher would stop every later notice, silently
                    logger.exception("sglang-harden: abort watcher pass for %s failed; polling on", addr)

    def _poll_addr(self, addr: str, entries: list[tuple[int, object]]) -> None:
        by_room = dict(entries)
        rooms = list(by_room)
        for start in range(0, len(rooms), MAX_ROOMS_PER_QUERY):
            chunk = rooms[start : start + MAX_ROOMS_PER_QUERY]
            for abort in fetch_aborts(addr, chunk):
                with self._lock:
                    self._hits[abort.room] = abort
                    while len(self._hits) > BOARD_CAPACITY:
                        self._hits.pop(next(iter(self._hits)))
                    self._waiting.get(addr, {}).pop(abort.room, None)  # the first word on a room stands
                self._on_abort(by_room[abort.room], abort)


def _concluded(receiver: object) -> bool:
    """SGLang's receiver reached its final state (transferred or failed): prefill's word can change nothing now,
    so its room leaves the poll (a receiver object can outlive its request by minutes)."""
    return getattr(receiver, "conclude_state", None) is not None


def fetch_aborts(addr: str, rooms: list[int]) -> list[PeerAbort]:
    target = abort_wire.rooms_target(rooms)
    try:
        status, body = signing.CLIENT.request("GET", addr, target, HTTP_TIMEOUT_S)
        data = json.loads(body) if status == 200 else None
    except (http.client.HTTPException, OSError, ValueError) as exc:
        logger.debug("sglang-harden: abort query to %s failed: %s", addr, exc)
        return []
    if data is None:
        logger.debug("sglang-harden: abort query to %s answered HTTP %s", addr, status)
        return []
    found, malformed = abort_wire.parse_board_answer(data)
    for entry in malformed:
        logger.warning("sglang-harden: malformed abort entry from %s: %r", addr, entry)
    return found
