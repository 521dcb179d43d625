"""Page ownership tags on decode (sglang-harden backport, not upstream SGLang code).

Invariant (sglang-harden's page_tags guard): before decode commits a transfer, every prompt page in SGLang's page
table for the request is owned by that request's own transfer reservation and was written by it (its cached
prefix aside: those pages must hold written KV); otherwise the request is aborted with 500 and never decoded.

Decode keeps a ledger of its KV pages (owner, generation, state), fed from three places:
- ``note_published``: the prealloc queue handed a request's destination pages to the transfer backend
  (``send_metadata``, any backend): they are reserved for ``room:<bootstrap_room>`` and being written;
- ``note_freed``: the KV allocator took pages back (``TokenToKVPoolAllocator.free``,
  ``PagedTokenToKVPoolAllocator._release_page_ids``): free again, whoever held them;
- ``refusal_at_commit``: the transfer queue is about to commit a finished transfer: its pages are written; then
  the request's page table is checked against the ledger.
A page the table points at that the request does not own (another request's, or a free page still holding
whatever its last owner left) is the incident's failure: decode would attend over someone else's KV.

The ledger and the check are sglang-harden's own code (``guards/page_ledger.py``, ``guards/page_tags.py``), put
in below when the series is generated, so a patched and a plugin decode judge alike.
``SGLANG_HARDEN_PAGE_TAGS``: ``enforce`` (default, abort), ``log`` (log the refusal, decode anyway), ``off``
(keep no ledger). Any other value refuses to start.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from enum import Enum

logger = logging.getLogger(__name__)

MODE_ENV = "SGLANG_HARDEN_PAGE_TAGS"
MAX_OPEN_TRANSFERS = 1 << 16  # rooms published and not yet committed (failed ones age out past this)

# sglang-harden's native ledger library is not part of the backport: the ledger runs its numpy path.
NOT_HANDLED, DONE = 0, 1
LedgerOps = None


def ledger_library() -> None:
    return None


# <prelude>


# <bundle sglang_harden/guards/base.py sglang_harden/kernels/page_arrays.py sglang_harden/guards/page_ledger.py sglang_harden/guards/page_tags.py>


# ---- the backport's own glue: SGLang's objects in, the guard's decisions out


MODE = mode_from_env(MODE_ENV)


def _as_pages(indices: Any) -> Any:
    """An index tensor or array as an int64 numpy array of its own (a CUDA tensor is copied to the host)."""
    import numpy as np

    if hasattr(indices, "detach"):
        indices = indices.detach().cpu().numpy()
    return np.array(indices, dtype=np.int64)


class DecodePages:
    """The page ledger of one decode scheduler's KV allocator, and the transfers handed pages and not committed."""

    def __init__(self, allocator: Any) -> None:
        self.allocator = allocator
        self.page_size = int(getattr(allocator, "page_size", 1) or 1)
        self.ledger = PageLedger(int(allocator.size) // self.page_size + 2, native=False)
        # room -> (owner, generation, pages), or the reason the pages could not be recorded
        self.transfers: OrderedDict[int, tuple[str, int, Any] | str] = OrderedDict()

    def publish(self, room: int, pages: Any) -> None:
        owner = f"room:{room}"
        try:
            generation = self.ledger.reserve_bulk(owner, pages, PageState.WRITING, handed_over=True)
            record: tuple[str, int, Any] | str = (owner, generation, pages)
        except LedgerError as exc:
            record = f"destination page not free in the page ledger when handed to the transfer: {exc}"
        self.transfers[room] = record
        self.transfers.move_to_end(room)
        while len(self.transfers) > MAX_OPEN_TRANSFERS:
            self.transfers.popitem(last=False)

    def release(self, pages: Any) -> None:
        """Pages back on the allocator's free list: FREE in the ledger, whichever owner held them."""
        for owner, owned in self.ledger.owner_groups(pages):
            self.ledger.release_bulk(owner, owned, writer_drained=True)

    def refusal(self, req: Any, req_to_token: Any) -> str | None:
        """Why the request must not be decoded, or None: the transfer's pages are written, the page table is
        checked against the ledger."""
        record = self.transfers.pop(int(req.bootstrap_room), None)
        if record is None:
            return f"no record of the pages handed to the transfer of room {req.bootstrap_room}"
        if isinstance(record, str):
            return record
        owner, generation, pages = record
        self.ledger.move_bulk(owner, pages, PageState.WRITTEN)
        decision = check_page_table(self.ledger, owner, generation, self._table_pages(req, req_to_token),
                                    self._prefix_pages(req))
        return None if decision.allows else decision.reason

    def _table_pages(self, req: Any, req_to_token: Any) -> list[int]:
        kv = getattr(req, "kv", None)
        pool_idx = getattr(kv, "req_pool_idx", None) if kv is not None else None
        if pool_idx is None:
            pool_idx = req.req_pool_idx
        rows = _as_pages(req_to_token[pool_idx, : len(req.origin_input_ids)])
        return distinct(rows // self.page_size).tolist()

    def _prefix_pages(self, req: Any) -> list[int]:
        prefix = getattr(req, "prefix_indices", None)
        if prefix is None or len(prefix) == 0:
            return []
        return distinct(_as_pages(prefix) // self.page_size).tolist()


NODE: DecodePages | None = None


def note_published(allocator: Any, receiver: Any, page_indices: Any) -> None:
    """Decode handed ``page_indices`` (page numbers) of ``allocator`` to ``receiver``'s transfer."""
    global NODE

    room = getattr(receiver, "bootstrap_room", None)
    if MODE == "off" or room is None or getattr(receiver, "bootstrap_infos", None) is None:
        return  # nothing was published: no writer for these pages
    if NODE is None or NODE.allocator is not allocator:
        NODE = DecodePages(allocator)
        logger.info("sglang-harden page_tags: ledger over %s KV pages (page size %s), mode %s",
                    NODE.ledger.num_pages, NODE.page_size, MODE)
    NODE.publish(int(room), _as_pages(page_indices))


def note_freed(allocator: Any, *page_ids: Any) -> None:
    """``allocator`` took ``page_ids`` back (token slots when its page size is 1)."""
    node = NODE
    if node is None or allocator is not node.allocator:
        return
    for ids in page_ids:
        if len(ids):
            node.release(_as_pages(ids))


def refusal_at_commit(req: Any, req_to_token: Any) -> str | None:
    """The message to abort ``req`` with before its transfer is committed (enforce mode), else None."""
    if MODE == "off":
        return None
    node = NODE
    reason = ("no page ledger: no transfer was ever handed pages in this process" if node is None
              else node.refusal(req, req_to_token))
    if reason is None:
        return None
    logger.error("sglang-harden page_tags %s: rid=%s room=%s: %s", "abort" if MODE == "enforce" else
                 "abort_logged (log mode: decoding anyway)", req.rid, req.bootstrap_room, reason)
    return reason if MODE == "enforce" else None
