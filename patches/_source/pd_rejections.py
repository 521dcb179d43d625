"""Prefill -> decode notice of rejected requests (sglang-harden backport, not upstream SGLang code).

When prefill rejects or retires a request that decode has already started to receive (too long for
prefill's pool, aborted before its final KV send), nothing in the KV transfer ever tells decode: decode
keeps the pages it reserved and waits for SGLANG_DISAGGREGATION_WAITING_TIMEOUT (300 s by default), then
answers 500. This module closes that gap through the bootstrap server decode already talks to:

- prefill's scheduler PUTs ``{room, status_code, message, sent_kv}`` to ``/pd_rejections`` on its own
  bootstrap server (background thread; a scheduler never blocks on it; accepted from that host only);
- decode's KV manager polls ``GET /pd_rejections?rooms=...`` for the rooms it still waits on and marks a
  rejected room Failed in its own status table, so the request leaves through SGLang's ordinary
  transfer-failure path (pages released, TP ranks agree through the usual poll all-reduce), answering
  with prefill's own status code and message.

Why not the transfer backend's own failure message: a request rejected at prefill's door never gets a
sender, decode's destination info may not even have reached prefill yet, and each backend (Mooncake,
NIXL, ...) has its own wire format without room for a status or text. The bootstrap server is common to
all backends and already serves decode over HTTP. Like the existing ``/route`` endpoint it is not
authenticated unless ``pd_auth`` (the series' authentication patch) is applied too. The wire format is
sglang-harden's own (its plugin runs the same code), so a patched prefill and a plugin decode understand each
other, and the reverse.
A prompt refused by prefill's tokenizer (it never reaches the scheduler) is posted from the tokenizer
manager, which runs the bootstrap server in the same process (``front_door_refusals``).
Env: SGLANG_PD_REJECTION_POLL_INTERVAL (seconds, default 0.25; 0 disables decode's poller).
"""

from __future__ import annotations

import functools
import ipaddress
import json
import logging
import os
import queue
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

logger = logging.getLogger(__name__)

# <embed sglang_harden/channels/abort_wire.py>

HTTP_TIMEOUT_S = 2.0
Verdict = Tuple[int, str]
BOARD = AbortBoard()


def add_routes(app: Any) -> None:
    """Register PUT/GET ``/pd_rejections`` on the bootstrap server's aiohttp app."""
    from aiohttp import web

    async def put(request: Any) -> Any:
        if not request_from_this_host(request):
            return web.json_response({"error": "rejections are accepted from this host only"}, status=403)
        try:
            BOARD.post(parse_notice(await request.read()))
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response({"ok": True})

    async def get(request: Any) -> Any:
        try:
            rooms = parse_rooms_query(request.query.get("rooms", ""))
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response(board_answer(BOARD, rooms))

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
        self._queue: "queue.Queue[PeerAbort]" = queue.Queue(maxsize=BOARD_CAPACITY)
        threading.Thread(target=self._run, name="pd-rejection-publisher", daemon=True).start()

    def publish(self, abort: PeerAbort) -> None:
        try:
            self._queue.put_nowait(abort)
        except queue.Full:
            logger.error("pd_rejections: queue full, room %s not published", abort.room)

    def _run(self) -> None:
        while True:
            abort = self._queue.get()
            for attempt in range(5):
                if _put(self._url, notice_body(abort)):
                    break
                time.sleep(0.2 * (attempt + 1))
            else:
                logger.error("pd_rejections: could not publish room %s to %s", abort.room, self._url)


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


def publish(kv_manager: Any, req: Any, sent_kv: bool = True) -> None:
    """Tell decode (through this prefill's bootstrap server) that ``req``'s room is rejected; ``sent_kv``
    False when no KV write was ever queued for it (refused at the door: decode may free its pages at once)."""
    verdict = abort_verdict(req)
    base_url = getattr(kv_manager, "bootstrap_base_url", None)
    room = getattr(req, "bootstrap_room", None)
    if verdict is None or base_url is None or room is None or getattr(kv_manager, "attn_tp_rank", 0) != 0:
        return
    with _publishers_lock:
        publisher = _publishers.get(base_url) or _publishers.setdefault(base_url, _Publisher(base_url))
    publisher.publish(PeerAbort(int(room), verdict[0], verdict[1][:MAX_MESSAGE_CHARS], sent_kv))


def front_door_refusals(validate: Any) -> Any:
    """Decorates ``TokenizerManager._validate_one_request``: a prompt prefill's tokenizer refuses (too long for the
    context, a bad option) never reaches its scheduler, so no door posts it; post it here, in the process that
    serves the bootstrap server, so decode answers its half at once instead of holding its pages until timeout."""

    @functools.wraps(validate)
    def validate_and_post(self: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return validate(self, obj, *args, **kwargs)
        except ValueError as exc:
            post_front_door_refusal(self, obj, exc)
            raise

    return validate_and_post


def front_door_refusals_async(tokenize: Any) -> Any:
    """Decorates ``TokenizerManager._tokenize_one_request`` the same way (it validates, and refuses on its own)."""

    @functools.wraps(tokenize)
    async def tokenize_and_post(self: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await tokenize(self, obj, *args, **kwargs)
        except ValueError as exc:
            post_front_door_refusal(self, obj, exc)
            raise

    return tokenize_and_post


def post_front_door_refusal(tokenizer_manager: Any, obj: Any, exc: ValueError) -> None:
    """Post a refusal of a PD prefill's tokenizer on this process's board (once per refusal)."""
    mode = getattr(getattr(tokenizer_manager, "server_args", None), "disaggregation_mode", None)
    room = getattr(obj, "bootstrap_room", None)
    if str(getattr(mode, "value", mode)) != "prefill" or getattr(exc, "_pd_rejection_posted", False):
        return
    if not isinstance(room, int) or isinstance(room, bool):
        return
    BOARD.post(PeerAbort(room, 400, str(exc)[:MAX_MESSAGE_CHARS], False))
    try:
        exc._pd_rejection_posted = True  # type: ignore[attr-defined]
    except AttributeError:
        pass


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

        url = f"http://{addr}" + rooms_target(rooms)
        try:
            with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as response:
                found, malformed = parse_board_answer(json.loads(response.read(1 << 20)))
        except (urllib.error.URLError, OSError, ValueError) as exc:
            logger.debug("pd_rejections: query to %s failed: %s", addr, exc)
            return
        for entry in malformed:
            logger.warning("pd_rejections: malformed entry from %s: %r", addr, entry)
        for abort in found:
            room, status, message = abort.room, abort.status_code, abort.message
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
