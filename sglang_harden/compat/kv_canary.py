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
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sglang_harden import events
from sglang_harden.compat.runtime import RUNTIME
from sglang_harden.config import Mode
from sglang_harden.guards import canary
from sglang_harden.guards.base import Decision, Verdict
from sglang_harden.kernels.digest_spec import MASK64, to_signed64

logger = logging.getLogger("sglang_harden")

Func = Callable[..., Any]
MAX_ROOMS = 65536


@dataclass(frozen=True)
class Stamp:
    marker: int
    pages: tuple[int, ...]


class Stamps:
    """Rooms decode stamped, oldest dropped first beyond ``MAX_ROOMS``."""

    def __init__(self) -> None:
        self._rooms: OrderedDict[int, Stamp] = OrderedDict()

    def add(self, room: int, stamp: Stamp) -> None:
        self._rooms[room] = stamp
        while len(self._rooms) > MAX_ROOMS:
            self._rooms.popitem(last=False)

    def has(self, room: int) -> bool:
        return room in self._rooms

    def pop(self, room: int) -> Stamp | None:
        return self._rooms.pop(room, None)


STAMPS = Stamps()


def canary_buffers(pool: Any) -> list[Any]:
    """First layer's K and last layer's V (MLA: first and last latent layer): a transfer cut short at either
    end of the layer loop leaves one of them stamped."""
    k_buffers = getattr(pool, "k_buffer", None)
    if k_buffers:
        return [k_buffers[0], pool.v_buffer[-1]]
    latent = pool.kv_buffer
    return [latent[0], latent[-1]] if len(latent) > 1 else [latent[0]]


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


# ------------------------------------------------------------------------- the stamps in torch tensors


def _marker_column(buffer: Any) -> Any:
    """The first 8 bytes of every token row of ``buffer`` (``[slots, heads, dim]``) as one int64 column."""
    import torch

    rows = buffer.view(torch.uint8).reshape(buffer.shape[0], -1)
    if rows.shape[1] < 8:
        raise ValueError("a token row must hold at least 8 bytes to carry a canary stamp")
    return rows[:, :8].view(torch.int64).squeeze(1)


def stamp(buffers: Sequence[Any], slots: Sequence[int] | Any, marker: int, synchronize: bool = True) -> None:
    """Write ``marker`` into the fixed slot of each reserved page, in every buffer of ``buffers``.

    Call at reservation, before the page indices reach the sender; ``synchronize`` waits for the device.
    """
    import torch

    for buffer in buffers:
        column = _marker_column(buffer)
        idx = torch.as_tensor(slots, dtype=torch.int64).to(buffer.device)
        column.index_fill_(0, idx, to_signed64(marker))
    if synchronize and buffers and buffers[0].is_cuda:
        torch.cuda.synchronize(buffers[0].device)


def still_stamped(buffers: Sequence[Any], slots: Sequence[int] | Any, marker: int) -> list[int]:
    """Positions (into ``slots``) whose fixed slot still holds ``marker`` in any of ``buffers``."""
    import torch

    hit = None
    for buffer in buffers:
        column = _marker_column(buffer)
        idx = torch.as_tensor(slots, dtype=torch.int64).to(buffer.device)
        same = column.index_select(0, idx) == to_signed64(marker)
        hit = same if hit is None else hit | same
    if hit is None:
        return []
    return torch.nonzero(hit).flatten().tolist()


def check_stamps(
    rid: str, buffers: Sequence[Any], pages: Sequence[int], page_size: int, marker: int, first_offset: int = 0
) -> Decision:
    """The commit decision from the stamps alone."""
    positions = still_stamped(buffers, canary.stamp_slots(pages, page_size, first_offset), marker & MASK64)
    return canary.decide_commit(rid, pages, [pages[i] for i in positions])
