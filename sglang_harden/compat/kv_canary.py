"""Canary hooks: decode stamps the pages it hands to the sender and, before commit, finds any still stamped.

When decode tells prefill where to write a request's KV (the backend receiver's ``send_metadata``), it writes a
fresh 64-bit marker into the first token row of each of those pages, in the first layer's K and the last
layer's V (:func:`stamp`), before the indices leave. A transfer writes whole pages,
so every page it wrote has lost its marker; before commit (``_commit_transfer_to_req``) a page still carrying
its marker was never written, and the request is aborted instead of attending over a previous owner's KV.

The KV pool comes from decode's scheduler (recorded at its start-up); stamps are per room, at most once per
room (re-stamping a page with a transfer in flight could erase a write), and bounded in number.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from sglang_harden import events
from sglang_harden.compat.runtime import RUNTIME
from sglang_harden.config import Mode
from sglang_harden.guards import canary
from sglang_harden.guards.base import Decision, Verdict
from sglang_harden.kernels.canary_stamps import (  # noqa: F401 - stamp helpers, used through this module
    MAX_ROOMS,
    Stamp,
    Stamps,
    canary_buffers,
    check_stamps,
    stamp,
    still_stamped,
)

logger = logging.getLogger("sglang_harden")

Func = Callable[..., Any]


STAMPS = Stamps()


def stamp_before_send(original: Func) -> Func:
    """``<backend>KVReceiver.send_metadata(kv_indices, …)``: stamp the destination pages, then send them."""

    def send_metadata(self: Any, kv_indices: Any, *args: Any, **kwargs: Any) -> Any:
        room = getattr(self, "bootstrap_room", None)
        pool = RUNTIME.decode_kv_pool
        if RUNTIME.config.canary is not Mode.OFF and room is not None and pool is not None and len(kv_indices):
            _stamp(int(room), [int(p) for p in kv_indices], pool)
        return original(self, kv_indices, *args, **kwargs)

    return send_metadata


def _stamp(room: int, pages: list[int], pool: Any) -> None:
    if STAMPS.has(room):
        return
    marker = canary.new_marker(str(room))
    stamp(canary_buffers(pool), canary.stamp_slots(pages, int(pool.page_size)), marker)
    STAMPS.add(room, Stamp(marker, tuple(pages)))


def check_before_commit(is_fake_transfer: Callable[[Any], bool],
                        abort_transferred: Callable[[Any, Any, Decision], None],
                        agree: Callable[[Any, Decision, str], Decision]) -> Callable[[Any, Any, dict[str, Any]], bool]:
    """Commit-chain step (``DecodeTransferQueue._commit_transfer_to_req``): refuse when a stamped page is
    unwritten."""

    def canary_step(queue: Any, decode_req: Any, _context: dict[str, Any]) -> bool:
        mode = RUNTIME.config.canary
        req = decode_req.req
        if mode is Mode.OFF or is_fake_transfer(req):
            return False
        rid = str(req.rid)
        decision = agree(queue, _local_decision(rid, getattr(req, "bootstrap_room", None)), rid)
        if events.record(decision, mode, room=getattr(req, "bootstrap_room", None)):
            abort_transferred(queue, decode_req, decision)
            return True
        return False

    return canary_step


def _local_decision(rid: str, room: Any) -> Decision:
    stamp = STAMPS.pop(int(room)) if room is not None else None
    pool = RUNTIME.decode_kv_pool
    if stamp is None or pool is None:
        reason = f"request {rid}: no canary stamp recorded for room {room}; refusing to decode unverified pages"
        return Decision(canary.GUARD, Verdict.ABORT, reason, canary.ABORT_STATUS, {"rid": rid, "room": room})
    try:
        return check_stamps(rid, canary_buffers(pool), stamp.pages, int(pool.page_size), stamp.marker)
    except Exception as exc:  # noqa: BLE001 - cannot decide: fail closed
        reason = f"request {rid}: canary check failed ({exc!r}); refusing to decode unverified pages"
        return Decision(canary.GUARD, Verdict.ABORT, reason, canary.ABORT_STATUS, {"rid": rid})
