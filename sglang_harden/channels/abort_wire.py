"""Abort notices: how prefill tells decode that a bootstrap room is dead, in one format for the plugin and the
backport series (a patched prefill notifies a plugin decode and the reverse).

Prefill's processes post to their own bootstrap server, which decode already talks to:

- ``PUT /pd_rejections`` body ``{"room": int, "status_code": 4xx|5xx, "message": str, "sent_kv": bool}``;
  ``sent_kv`` False says prefill never queued a KV write for the room (refused at its door), so decode may
  free the room's pages at once. Absent means True. Accepted from the server's own host only.
- ``GET /pd_rejections?rooms=1,2,…`` (at most 256) answers ``{"rooms": {"<room>": {"status_code",
  "message", "sent_kv"}}}`` for the rooms on the board.

The board keeps the first word on a room (a door's "never sent" is not overwritten by a later retirement),
for 900 s and 65,536 rooms at most, oldest dropped first.
"""

from __future__ import annotations

import ipaddress
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

# ---- embedded in the backport series from here on

ROUTE = "/pd_rejections"
BOARD_CAPACITY = 65536
BOARD_TTL_S = 900.0
MAX_ROOMS_PER_QUERY = 256
MAX_NOTICE_BYTES = 64 * 1024
MAX_MESSAGE_CHARS = 4096


@dataclass(frozen=True)
class PeerAbort:
    """Prefill gave up on ``room``; ``sent_kv`` False: it never queued a KV write for it."""

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
        """The first word on a room stands."""
        with self._lock:
            if abort.room in self._entries:
                return
            self._entries[abort.room] = (time.monotonic(), abort)
            while len(self._entries) > self._capacity:
                self._entries.popitem(last=False)

    def lookup(self, rooms: list[int]) -> list[PeerAbort]:
        now = time.monotonic()
        with self._lock:
            while self._entries:
                stamp = next(iter(self._entries.values()))[0]
                if now - stamp < self._ttl_s:
                    break
                self._entries.popitem(last=False)
            return [self._entries[room][1] for room in rooms if room in self._entries]


def notice_body(abort: PeerAbort) -> bytes:
    return json.dumps({"room": abort.room, "status_code": abort.status_code, "message": abort.message,
                       "sent_kv": abort.sent_kv}).encode()


def parse_notice(body: bytes) -> PeerAbort:
    """A PUT body as a notice; ValueError with a short reason on anything malformed."""
    if len(body) > MAX_NOTICE_BYTES:
        raise ValueError(f"body over {MAX_NOTICE_BYTES} bytes")
    data = json.loads(body)
    if not isinstance(data, dict):
        raise ValueError("body must be a JSON object")
    room, status, message = data.get("room"), data.get("status_code"), data.get("message")
    if type(room) is not int or type(status) is not int or not isinstance(message, str):
        raise ValueError("need integer room, integer status_code, string message")
    if not 400 <= status <= 599:
        raise ValueError("status_code must be an HTTP error status")
    sent_kv = data.get("sent_kv", True)
    if not isinstance(sent_kv, bool):
        raise ValueError("sent_kv must be a boolean")
    return PeerAbort(room, status, message[:MAX_MESSAGE_CHARS], sent_kv)


def rooms_target(rooms: list[int]) -> str:
    """The GET target asking about ``rooms`` (at most MAX_ROOMS_PER_QUERY)."""
    return f"{ROUTE}?rooms=" + ",".join(str(int(room)) for room in rooms)


def parse_rooms_query(raw: str) -> list[int]:
    rooms = [int(part) for part in raw.split(",") if part.strip()]
    if len(rooms) > MAX_ROOMS_PER_QUERY:
        raise ValueError(f"at most {MAX_ROOMS_PER_QUERY} rooms per query")
    return rooms


def board_answer(board: AbortBoard, rooms: list[int]) -> dict[str, Any]:
    entries = {str(a.room): {"status_code": a.status_code, "message": a.message, "sent_kv": a.sent_kv}
               for a in board.lookup(rooms)}
    return {"rooms": entries}


def parse_board_answer(data: Any) -> tuple[list[PeerAbort], list[Any]]:
    """The notices in a GET answer, and the entries that were malformed. A missing ``sent_kv`` (or anything
    but an explicit False) reads as "may have sent"."""
    entries = data.get("rooms", {}) if isinstance(data, dict) else {}
    found: list[PeerAbort] = []
    malformed: list[Any] = []
    for room_text, entry in (entries.items() if isinstance(entries, dict) else ()):
        try:
            sent_kv = entry.get("sent_kv", True) is not False
            found.append(PeerAbort(int(room_text), int(entry["status_code"]), str(entry["message"]), sent_kv))
        except (AttributeError, KeyError, TypeError, ValueError):
            malformed.append(entry)
    return found, malformed


def is_same_host(remote: str | None, local: str | None) -> bool:
    """Whether an HTTP peer is this host: a loopback address, or the very address the server answered on
    (prefill's schedulers post to their own bootstrap server, whichever address it binds)."""
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


def request_from_this_host(request: Any) -> bool:
    """Whether an aiohttp request came from this host (:func:`is_same_host` of its peer and the server's address)."""
    sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
    return is_same_host(request.remote, sockname[0] if sockname else None)
