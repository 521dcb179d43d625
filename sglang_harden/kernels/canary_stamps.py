"""The canary's stamps in decode's KV pool (torch; CPU or CUDA), shared by the plugin (``compat/kv_canary.py``)
and the backport series (bundled into its ``pd_canary`` module): which buffers carry a stamp, writing a marker into
the fixed slot of each reserved page, finding the slots that still hold it, and the stamps decode keeps per room.
Decisions come from :mod:`sglang_harden.guards.canary`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sglang_harden.guards.base import Decision
from sglang_harden.guards.canary import decide_commit, stamp_slots
from sglang_harden.kernels.digest_spec import MASK64, to_signed64

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
    positions = still_stamped(buffers, stamp_slots(pages, page_size, first_offset), marker & MASK64)
    return decide_commit(rid, pages, [pages[i] for i in positions])
