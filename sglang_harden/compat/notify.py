"""The abort side channel: prefill tells decode, through prefill's bootstrap server, that a room is dead.

Upstream has no prefill->decode abort message for a room that never sent KV (a rejected request never gets
a sender), so decode waits for its waiting timeout holding pages. We add two routes to the bootstrap server
that decode already talks to:

- ``PUT  /sglang_harden/abort``          prefill posts ``{room, status_code, message}``
- ``GET  /sglang_harden/aborts?rooms=…``  decode asks about the rooms it is waiting on

Decode polls from a background thread and marks a hit room failed in its own KV manager, so the request
leaves through SGLang's normal transfer-failure path on every TP rank alike (ranks all-reduce their polls).
This module knows no SGLang names: the family adapter passes the callbacks that touch SGLang objects.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from sglang_harden.compat import signing

logger = logging.getLogger("sglang_harden")

ABORT_PATH = "/sglang_harden/abort"
ABORTS_PATH = "/sglang_harden/aborts"
BOARD_CAPACITY = 65536
BOARD_TTL_S = 900.0
POLL_INTERVAL_S = 0.2
HTTP_TIMEOUT_S = 2.0
MAX_ROOMS_PER_QUERY = 256


@dataclass(frozen=True)
class PeerAbort:
    """Prefill gave up on ``room``. ``sent_kv`` False means prefill never queued a KV write for the room (it was
    refused before its sender existed), so decode may free the room's pages at once instead of quarantining."""

    room: int
    status_code: int
    message: str
    sent_kv: bool = True


class AbortBoard:
    """Rooms prefill gave up on, kept for a bounded time and count (oldest dropped first)."""

    def __init__(self, capacity: int = BOARD_CAPACITY, ttl_s: float = BOARD_TTL_S) -> None:
        self._capacity = capacity
        self._ttl_s = ttl_s
        self._entries: OrderedDict[int, tuple[float, PeerAbort]] = OrderedDict()
        self._lock = threading.Lock()

    def post(self, abort: PeerAbort) -> None:
        """The first word on a room stands (the door's "never sent" is not overwritten by a later retirement)."""
        with self._lock:
            if abort.room in self._entries:
                return
            self._entries[abort.room] = (time.monotonic(), abort)
            while len(self._entries) > self._capacity:
                self._entries.popitem(last=False)

    def lookup(self, rooms: list[int]) -> list[PeerAbort]:
        now = time.monotonic()
        with self._lock:
            self._expire(now)
            return [self._entries[r][1] for r in rooms if r in self._entries]

    def _expire(self, now: float) -> None:
        while self._entries:
            room, (stamp, _) = next(iter(self._entries.items()))
            if now - stamp < self._ttl_s:
                return
            del self._entries[room]


BOARD = AbortBoard()


def parse_abort_body(body: bytes) -> PeerAbort:
    """Validate a PUT body; raise ValueError with a short reason on anything malformed."""
    data = json.loads(body)
    if not isinstance(data, dict):
        raise ValueError("body must be a JSON object")
    room, status, message = data.get("room"), data.get("status_code"), data.get("message")
    if not isinstance(room, int) or not isinstance(status, int) or not isinstance(message, str):
        raise ValueError("need integer room, integer status_code, string message")
    if not 400 <= status <= 599:
        raise ValueError("status_code must be an HTTP error status")
    sent_kv = data.get("sent_kv", True)
    if not isinstance(sent_kv, bool):
        raise ValueError("sent_kv must be a boolean")
    return PeerAbort(room, status, message[:4096], sent_kv)


def is_same_host(remote: str | None, local: str | None) -> bool:
    """Whether an HTTP peer is this host: a loopback address, or the very address the server answered on
    (prefill's schedulers post to their own bootstrap server, whichever address it binds)."""
    import ipaddress

    if not remote:
        return False
    try:
        peer = ipaddress.ip_address(remote.split("%")[0])
    except ValueError:
        return False
    if peer.is_loopback:
        return True
    try:
        return local is not None and peer == ipaddress.ip_address(local.split("%")[0])
    except ValueError:
        return False


def parse_rooms_query(raw: str) -> list[int]:
    rooms = [int(part) for part in raw.split(",") if part.strip()]
    if len(rooms) > MAX_ROOMS_PER_QUERY:
        raise ValueError(f"at most {MAX_ROOMS_PER_QUERY} rooms per query")
    return rooms


def aborts_payload(rooms: list[int], board: AbortBoard | None = None) -> dict[str, object]:
    board = board or BOARD
    return {
        "aborts": {
            str(a.room): {"status_code": a.status_code, "message": a.message, "sent_kv": a.sent_kv}
            for a in board.lookup(rooms)
        }
    }


class Publisher:
    """Posts aborts to the local bootstrap server from a background thread (never blocks a scheduler)."""

    def __init__(self, base_url: str) -> None:
        self._base_url = base_url.rstrip("/")
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
        body = json.dumps(
            {"room": abort.room, "status_code": abort.status_code, "message": abort.message, "sent_kv": abort.sent_kv}
        )
        for attempt in range(5):
            try:
                request = urllib.request.Request(
                    self._base_url + ABORT_PATH, data=body.encode(), method="PUT",
                    headers={"Content-Type": "application/json", **_signed("PUT", ABORT_PATH, body.encode())},
                )
                with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError) as exc:
                logger.warning("sglang-harden: publishing abort of room %s failed: %s", abort.room, exc)
            time.sleep(0.2 * (attempt + 1))
        logger.error("sglang-harden: gave up publishing abort of room %s to %s", abort.room, self._base_url)


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
    target = f"{ABORTS_PATH}?rooms=" + ",".join(str(r) for r in rooms)
    request = urllib.request.Request(f"http://{addr}{target}", headers=_signed("GET", target, b""))
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
            data = json.loads(response.read(1 << 20))
    except (urllib.error.URLError, OSError, ValueError) as exc:
        logger.debug("sglang-harden: abort query to %s failed: %s", addr, exc)
        return []
    aborts = data.get("aborts", {}) if isinstance(data, dict) else {}
    found = []
    for room_text, entry in aborts.items():
        try:
            sent_kv = entry.get("sent_kv", True) is not False  # anything but an explicit False: may have sent
            found.append(PeerAbort(int(room_text), int(entry["status_code"]), str(entry["message"]), sent_kv))
        except (KeyError, TypeError, ValueError):
            logger.warning("sglang-harden: malformed abort entry from %s: %r", addr, entry)
    return found


def _signed(method: str, target: str, body: bytes) -> dict[str, str]:
    """The control-plane token header for this request ({} without a configured secret)."""
    return signing.headers(method, target, body)
