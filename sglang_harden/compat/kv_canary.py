"""Canary hooks: decode stamps the pages it hands to the sender and, before commit, finds any still stamped.

When decode tells prefill where to write a request's KV (the backend receiver's ``send_metadata``), it writes a
fresh 64-bit marker into the first token row of each of those pages, in the first layer's K and the last
layer's V (:func:`stamp`), before the indices leave. A transfer writes whole pages, so every page it wrote has lost
its marker; before commit (the commit gate, :mod:`.commit_gate`) a page still carrying its marker was never written,
and the request is aborted instead of attending over a previous owner's KV.

Nothing here makes decode's scheduler wait for the GPU: the stamp and the check run on a private stream, and the
check's answer is read by the gate once it landed in pinned memory.

The KV pool comes from decode's scheduler (recorded at its start-up); stamps are per room, at most once per
room (re-stamping a page with a transfer in flight could erase a write), and bounded in number.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from sglang_harden.compat.runtime import RUNTIME
from sglang_harden.config import Mode
from sglang_harden.guards import canary
from sglang_harden.guards.base import Decision, Verdict
from sglang_harden.kernels.canary_stamps import (  # noqa: F401 - stamp helpers, used through this module
    MAX_ROOMS,
    CanaryGateStep,
    Stamp,
    Stamps,
    canary_buffers,
    check_stamps,
    decide_check,
    launch_check,
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
    """Stamp the room's pages; where the pool cannot be stamped the room stays unstamped, and the commit gate
    refuses it as unverified, saying why (log mode: counts and logs that) instead of the scheduler dying here."""
    if STAMPS.has(room):
        return
    try:
        marker = canary.new_marker(str(room))
        slots = stamp(canary_buffers(pool), canary.stamp_slots(pages, int(pool.page_size)), marker)
    except Exception as exc:  # noqa: BLE001 - cannot stamp (a pool it does not read): the commit gate fails it
        why = f"{type(pool).__name__} cannot be stamped: {exc!r}"
        UNSTAMPABLE[room] = why
        while len(UNSTAMPABLE) > MAX_ROOMS:
            UNSTAMPABLE.popitem(last=False)
        if (type(pool).__name__, type(exc).__name__) not in _warned:
            _warned.add((type(pool).__name__, type(exc).__name__))
            logger.warning("sglang-harden canary: decode's KV pool %s; each room it reserves is refused as "
                           "unverified at the commit", why)
        return
    STAMPS.add(room, Stamp(marker, tuple(pages), slots))


UNSTAMPABLE: OrderedDict[int, str] = OrderedDict()  # room -> why its pages could not be stamped
_warned: set[tuple[str, str]] = set()


class _CanaryStep(CanaryGateStep):
    """The commit gate's canary step; a room left unstamped by :func:`_stamp` is refused naming why."""

    def decide(self, queue: Any, decode_req: Any, pending: Any) -> Decision | None:
        room = getattr(decode_req.req, "bootstrap_room", None)
        why = UNSTAMPABLE.pop(int(room), None) if pending is None and room is not None else None
        if why is None:
            return super().decide(queue, decode_req, pending)
        rid = str(decode_req.req.rid)
        return Decision(canary.GUARD, Verdict.ABORT, f"request {rid}: decode's KV pool {why}; refusing to decode "
                        "unverified pages", canary.ABORT_STATUS, {"rid": rid, "room": room})


def canary_step() -> CanaryGateStep:
    """The commit gate's canary step over this process's stamps and decode's KV pool."""
    return _CanaryStep(STAMPS, lambda: RUNTIME.decode_kv_pool)
