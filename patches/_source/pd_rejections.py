"""Prefill -> decode notice of rejected requests (sglang-harden backport, not upstream SGLang code).

When prefill rejects or retires a request that decode has already started to receive (too long for
prefill's pool, aborted before its final KV send), nothing in the KV transfer ever tells decode: decode
keeps the pages it reserved and waits for SGLANG_DISAGGREGATION_WAITING_TIMEOUT (300 s by default), then
answers 500. This module closes that gap through the bootstrap server decode already talks to:

- prefill's scheduler PUTs ``{room, status_code, message}`` to ``/pd_rejections`` on its own bootstrap
  server (background thread; a scheduler never blocks on it);
- decode's KV manager polls ``GET /pd_rejections?rooms=...`` for the rooms it still waits on and marks a
  rejected room Failed in its own status table, so the request leaves through SGLang's ordinary
  transfer-failure path (pages released, TP ranks agree through the usual poll all-reduce), answering
  with prefill's own status code and message.

Why not the transfer backend's own failure message: a request rejected at prefill's door never gets a
sender, decode's destination info may not even have reached prefill yet, and each backend (Mooncake,
NIXL, ...) has its own wire format without room for a status or text. The bootstrap server is common to
all backends and already serves decode over HTTP. Like the existing ``/route`` endpoint it is not
authenticated unless ``pd_auth`` (the series' authentication patch) is applied too.
Env: SGLANG_PD_REJECTION_POLL_INTERVAL (seconds, default 0.25; 0 disables decode's poller).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

logger = logging.getLogger(__name__)

ROUTE = "/pd_rejections"
BOARD_CAPACITY = 65536
BOARD_TTL_S = 900.0
MAX_ROOMS_PER_QUERY = 256
HTTP_TIMEOUT_S = 2.0
Verdict = Tuple[int, str]


class RejectionBoard:
    """Rooms prefill gave up on (bootstrap server process), bounded in count and age."""

    def __init__(self, capacity: int = BOARD_CAPACITY, ttl_s: float = BOARD_TTL_S) -> None:
        self._capacity, self._ttl_s = capacity, ttl_s
        self._entries: "OrderedDict[int, Tuple[float, int, str]]" = OrderedDict()
        self._lock = threading.Lock()

    def post(self, room: int, status_code: int, message: str) -> None:
        with self._lock:
            self._entries[room] = (time.monotonic(), status_code, message)
            self._entries.move_to_end(room)
            while len(self._entries) > self._capacity:
                self._entries.popitem(last=False)

    def lookup(self, rooms: List[int]) -> Dict[str, Dict[str, Any]]:
        now = time.monotonic()
        with self._lock:
            while self._entries:
                stamp = next(iter(self._entries.values()))[0]
                if now - stamp < self._ttl_s:
                    break
                self._entries.popitem(last=False)
            found = {r: self._entries[r] for r in rooms if r in self._entries}
        return {str(r): {"status_code": s, "message": m} for r, (_, s, m) in found.items()}


BOARD = RejectionBoard()


def parse_post(data: Any) -> Tuple[int, int, str]:
    """Validate a PUT body; raise ValueError on anything malformed."""
    if not isinstance(data, dict):
        raise ValueError("body must be a JSON object")
    room, status, message = data.get("room"), data.get("status_code"), data.get("message")
    if not isinstance(room, int) or not isinstance(status, int) or not isinstance(message, str):
        raise ValueError("need integer room, integer status_code, string message")
    if not 400 <= status <= 599:
        raise ValueError("status_code must be an HTTP error status")
    return room, status, message[:4096]


def parse_rooms(raw: str) -> List[int]:
    rooms = [int(part) for part in raw.split(",") if part.strip()]
    if len(rooms) > MAX_ROOMS_PER_QUERY:
        raise ValueError(f"at most {MAX_ROOMS_PER_QUERY} rooms per query")
    return rooms


def add_routes(app: Any) -> None:
    """Register PUT/GET ``/pd_rejections`` on the bootstrap server's aiohttp app."""
    from aiohttp import web

    async def put(request: Any) -> Any:
        try:
            room, status, message = parse_post(json.loads(await request.read()))
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        BOARD.post(room, status, message)
        return web.json_response({"ok": True})

    async def get(request: Any) -> Any:
        try:
            rooms = parse_rooms(request.query.get("rooms", ""))
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response({"rooms": BOARD.lookup(rooms)})

    app.router.add_put(ROUTE, put)
    app.router.add_get(ROUTE, get)


# ------------------------------------------------------------------ prefill side


def abort_verdict(req: Any) -> Optional[Verdict]:
    """(status, message) of the abort SGLang recorded on ``req`` (to_finish or finished_reason)."""
    for attr in ("finished_reason", "to_finish"):
        reason = getattr(req, attr, None)
        if reason is not None and type(reason).__name__ == "FINISH_ABORT":
            return int(getattr(reason, "status_code", None) or 500), str(reason.message)
    return None


class _Publisher:
    def __init__(self, base_url: str) -> None:
        self._url = base_url.rstrip("/") + ROUTE
        self._queue: "queue.Queue[Tuple[int, int, str]]" = queue.Queue(maxsize=BOARD_CAPACITY)
        threading.Thread(target=self._run, name="pd-rejection-publisher", daemon=True).start()

    def publish(self, room: int, status: int, message: str) -> None:
        try:
            self._queue.put_nowait((room, status, message))
        except queue.Full:
            logger.error("pd_rejections: queue full, room %s not published", room)

    def _run(self) -> None:
        while True:
            room, status, message = self._queue.get()
            body = json.dumps({"room": room, "status_code": status, "message": message}).encode()
            for attempt in range(5):
                if _put(self._url, body):
                    break
                time.sleep(0.2 * (attempt + 1))
            else:
                logger.error("pd_rejections: could not publish room %s to %s", room, self._url)


def _put(url: str, body: bytes) -> bool:
    request = urllib.request.Request(url, data=body, method="PUT", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError) as exc:
        logger.warning("pd_rejections: PUT %s failed: %s", url, exc)
        return False


_publishers: Dict[str, _Publisher] = {}
_publishers_lock = threading.Lock()


def publish(kv_manager: Any, req: Any) -> None:
    """Tell decode (through this prefill's bootstrap server) that ``req``'s room is rejected."""
    verdict = abort_verdict(req)
    base_url = getattr(kv_manager, "bootstrap_base_url", None)
    room = getattr(req, "bootstrap_room", None)
    if verdict is None or base_url is None or room is None or getattr(kv_manager, "attn_tp_rank", 0) != 0:
        return
    with _publishers_lock:
        publisher = _publishers.get(base_url) or _publishers.setdefault(base_url, _Publisher(base_url))
    publisher.publish(int(room), verdict[0], verdict[1])


# ------------------------------------------------------------------ decode side


class RejectionWatcher:
    """Decode: polls each prefill bootstrap server about the rooms decode still waits on."""

    def __init__(self, kv_manager: Any, interval_s: float) -> None:
        self._mgr = kv_manager
        self._interval_s = interval_s
        self._verdicts: "OrderedDict[int, Verdict]" = OrderedDict()
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="pd-rejection-watcher", daemon=True).start()

    def pop(self, room: Any) -> Optional[Verdict]:
        with self._lock:
            return self._verdicts.pop(room, None)

    def _waiting(self) -> Dict[str, List[int]]:
        from sglang.srt.disaggregation.base.conn import KVPoll

        status = self._mgr.request_status
        done = (KVPoll.Success, KVPoll.Failed)
        waiting: Dict[str, List[int]] = {}
        for addr, rooms in list(self._mgr.addr_to_rooms_tracker.items()):
            live = [r for r in list(rooms) if r is not None and status.get(r, KVPoll.Failed) not in done]
            if live:
                waiting[addr] = live
        return waiting

    def _run(self) -> None:
        while True:
            time.sleep(self._interval_s)
            try:
                for addr, rooms in self._waiting().items():
                    for start in range(0, len(rooms), MAX_ROOMS_PER_QUERY):
                        self._query(addr, rooms[start : start + MAX_ROOMS_PER_QUERY])
            except Exception:  # never let the watcher die
                logger.exception("pd_rejections: watcher pass failed")

    def _query(self, addr: str, rooms: List[int]) -> None:
        from sglang.srt.disaggregation.base.conn import KVPoll

        url = f"http://{addr}{ROUTE}?rooms=" + ",".join(str(r) for r in rooms)
        try:
            with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response:
                found = json.loads(response.read(1 << 20)).get("rooms", {})
        except (urllib.error.URLError, OSError, ValueError, AttributeError) as exc:
            logger.debug("pd_rejections: query to %s failed: %s", addr, exc)
            return
        for room_text, entry in found.items():
            room, status, message = int(room_text), int(entry["status_code"]), str(entry["message"])
            with self._lock:
                self._verdicts[room] = (status, message)
                while len(self._verdicts) > BOARD_CAPACITY:
                    self._verdicts.popitem(last=False)
            logger.warning("pd_rejections: prefill %s rejected room %s: %s", addr, room, message)
            self._mgr.record_failure(room, f"Rejected by prefill: {message}")
            self._mgr.update_status(room, KVPoll.Failed)


def start_watcher(kv_manager: Any) -> Optional[RejectionWatcher]:
    interval = float(os.environ.get("SGLANG_PD_REJECTION_POLL_INTERVAL", "0.25"))
    return RejectionWatcher(kv_manager, interval) if interval > 0 else None


def decode_abort(kv_receiver: Any, room: Any, message: str, status_code: Any) -> Tuple[str, Any]:
    """Decode failure path: prefill's own (message, status) when prefill rejected ``room``, else the given."""
    watcher = getattr(getattr(kv_receiver, "kv_mgr", None), "rejection_watcher", None)
    verdict = watcher.pop(room) if watcher is not None else None
    return (message, status_code) if verdict is None else (verdict[1], verdict[0])
