"""The canary's stamps in decode's KV pool (torch; CPU or CUDA), shared by the plugin (``compat/kv_canary.py``)
and the backport series (bundled into its ``pd_canary`` module): which buffers carry a stamp, writing a marker into
the fixed slot of each reserved page, finding the slots that still hold it, and the stamps decode keeps per room.
Decisions come from :mod:`sglang_harden.guards.canary`.

On a GPU nothing here makes the host wait (:mod:`.device`): the slots go up from pinned memory, the stamp and the
check run on a private high-priority stream (so they do not queue behind the forward in flight), and the check's
answer comes back as a :class:`~.device.HostCopy` that the caller reads once it landed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sglang_harden.guards.base import Decision, Verdict
from sglang_harden.guards.canary import ABORT_STATUS, GUARD, decide_commit, stamp_slots
from sglang_harden.kernels.device import HostCopy, on_accelerator, side_stream, upload
from sglang_harden.kernels.digest_spec import MASK64, to_signed64

MAX_ROOMS = 65536


@dataclass(frozen=True)
class Stamp:
    marker: int
    pages: tuple[int, ...]
    slots: Any = None  # the stamped slots as a tensor on the pool's device (reused by the check)


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


def canary_buffers(pool: Any) -> list[Any]:
    """First layer's K and last layer's V (MLA: first and last latent layer): a transfer cut short at either
    end of the layer loop leaves one of them stamped."""
    k_buffers = getattr(pool, "k_buffer", None)
    if k_buffers:
        return [k_buffers[0], pool.v_buffer[-1]]
    latent = pool.kv_buffer
    return [latent[0], latent[-1]] if len(latent) > 1 else [latent[0]]


def _marker_column(buffer: Any) -> Any:
    """The first 8 bytes of every token row of ``buffer`` (``[slots, heads, dim]``) as one int64 column."""
    import torch

    rows = buffer.view(torch.uint8).reshape(buffer.shape[0], -1)
    if rows.shape[1] < 8:
        raise ValueError("a token row must hold at least 8 bytes to carry a canary stamp")
    return rows[:, :8].view(torch.int64).squeeze(1)


def _stream_for(buffer: Any) -> Any:
    return side_stream(buffer.device) if on_accelerator(buffer) else None


def _on(stream: Any) -> Any:
    """``torch.cuda.stream(stream)`` or, without one, a no-op context."""
    import contextlib

    if stream is None:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.stream(stream)


def slot_tensor(buffers: Sequence[Any], slots: Sequence[int] | Any) -> Any:
    """``slots`` as an int64 tensor on the buffers' device (uploaded from pinned memory: no blocking copy)."""
    import numpy as np
    import torch

    if isinstance(slots, torch.Tensor):
        return slots
    return upload(np.asarray(slots, dtype=np.int64), buffers[0], torch.int64)


def stamp(buffers: Sequence[Any], slots: Sequence[int] | Any, marker: int) -> Any:
    """Write ``marker`` into the fixed slot of each reserved page, in every buffer of ``buffers``; returns the slots
    as a device tensor (keep it for :func:`launch_check`).

    Call at reservation, before the page indices reach the sender. On a GPU the stamp runs on the private stream at
    once; it is not ordered after the forward in flight (waiting for it would let a fast transfer land first and
    be overwritten by the stamp)."""
    if not buffers:
        return None
    stream = _stream_for(buffers[0])
    with _on(stream):
        idx = slot_tensor(buffers, slots)
        for buffer in buffers:
            _marker_column(buffer).index_fill_(0, idx, to_signed64(marker))
    return idx


def launch_check(buffers: Sequence[Any], slots: Any, marker: int) -> HostCopy:
    """Start looking which of ``slots`` still hold ``marker`` in any of ``buffers``; the answer (one byte per slot,
    1: still stamped) lands in a :class:`HostCopy`. Ordered after the stamp (same stream)."""
    import torch

    stream = _stream_for(buffers[0]) if buffers else None
    with _on(stream):
        idx = slot_tensor(buffers, slots)
        hit = torch.zeros(idx.shape, dtype=torch.bool, device=idx.device)
        for buffer in buffers:
            hit |= _marker_column(buffer).index_select(0, idx) == to_signed64(marker)
        return HostCopy.launch([hit.to(torch.uint8)], stream)


def stamped_positions(check: HostCopy) -> list[int]:
    """Positions (into the checked slots) still stamped, once ``check`` landed."""
    import numpy as np

    return np.flatnonzero(check.numpy()).tolist()


def still_stamped(buffers: Sequence[Any], slots: Sequence[int] | Any, marker: int) -> list[int]:
    """Positions (into ``slots``) whose fixed slot still holds ``marker`` in any of ``buffers``, waiting for the
    answer (a host synchronisation on a GPU: tests and tools only; the commit path polls :func:`launch_check`)."""
    if not buffers:
        return []
    check = launch_check(buffers, slots, marker)
    check.wait()
    return stamped_positions(check)


def decide_check(rid: str, pages: Sequence[int], check: HostCopy) -> Decision:
    """The commit decision from a landed check of ``pages``' stamps."""
    return decide_commit(rid, pages, [pages[i] for i in stamped_positions(check)])


def check_stamps(
    rid: str, buffers: Sequence[Any], pages: Sequence[int], page_size: int, marker: int, first_offset: int = 0
) -> Decision:
    """The commit decision from the stamps alone, waiting for the answer (see :func:`still_stamped`)."""
    positions = still_stamped(buffers, stamp_slots(pages, page_size, first_offset), marker & MASK64)
    return decide_commit(rid, pages, [pages[i] for i in positions])


class CanaryGateStep:
    """Decode's canary step of the commit gate: launch the check of the room's stamps, decide once it landed.
    ``stamps``: the rooms stamped; ``pool()``: decode's KV pool (None before the first stamp)."""

    def __init__(self, stamps: Stamps, pool: Callable[[], Any]) -> None:
        self.stamps, self.pool = stamps, pool

    def launch(self, _queue: Any, decode_req: Any) -> Any:
        room = getattr(decode_req.req, "bootstrap_room", None)
        record = self.stamps.pop(int(room)) if room is not None else None
        pool = self.pool()
        if record is None or pool is None:
            return None
        try:
            return record, launch_check(canary_buffers(pool), record.slots, record.marker)
        except Exception as exc:  # noqa: BLE001 - cannot decide: fail closed
            return exc

    def decide(self, _queue: Any, decode_req: Any, pending: Any) -> Decision | None:
        rid = str(decode_req.req.rid)
        if pending is None:
            room = getattr(decode_req.req, "bootstrap_room", None)
            reason = f"request {rid}: no canary stamp recorded for room {room}; refusing to decode unverified pages"
            return Decision(GUARD, Verdict.ABORT, reason, ABORT_STATUS, {"rid": rid, "room": room})
        if isinstance(pending, Exception):
            reason = f"request {rid}: canary check failed ({pending!r}); refusing to decode unverified pages"
            return Decision(GUARD, Verdict.ABORT, reason, ABORT_STATUS, {"rid": rid})
        record, check = pending
        if not check.ready():
            return None
        return decide_check(rid, record.pages, check)
