"""Page ownership tags on decode (sglang-harden backport, not upstream SGLang code).

Invariant (sglang-harden's page_tags guard): before decode commits a transfer, every prompt page in SGLang's page
table for the request is owned by that request's own transfer reservation and was written by it (its cached
prefix aside: those pages must hold written KV); otherwise the request is aborted with 500 and never decoded.

Decode keeps a ledger of its KV pages (owner, generation, state), fed from three places:
- ``note_published``: the prealloc queue handed a request's destination pages to the transfer backend
  (``send_metadata``, any backend): they are reserved for ``room:<bootstrap_room>`` and being written;
- ``note_freed``: the KV allocator took pages back (``TokenToKVPoolAllocator.free``,
  ``PagedTokenToKVPoolAllocator._release_page_ids``): free again, whoever held them. The freed index lives on the
  GPU: it is copied to pinned memory without the scheduler waiting, and the ledger learns of the free once the
  copy landed (before the next reservation at the latest);
- ``GATE_STEP`` (the commit-gate patch's, 0.5.19+): when a transfer reports success, the request's page table row
  is copied to pinned memory on a private stream; once it landed the transfer's pages are written and the row is
  checked against the ledger. ``refusal_at_commit`` (series without the gate): the same check at the commit.
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


# <bundle sglang_harden/guards/base.py sglang_harden/kernels/page_arrays.py sglang_harden/guards/page_ledger.py sglang_harden/guards/page_tags.py sglang_harden/kernels/device.py>


# ---- the backport's own glue: SGLang's objects in, the guard's decisions out


MODE = mode_from_env(MODE_ENV)


def _as_pages(indices: Any) -> Any:
    """An index array (or a host tensor) as an int64 numpy array of its own (a device tensor would be copied to the
    host: a synchronisation, on the paths without the gate only)."""
    import numpy as np

    if hasattr(indices, "detach"):
        indices = indices.detach().cpu().numpy()
    return np.array(indices, dtype=np.int64).reshape(-1)


class DecodePages:
    """The page ledger of one decode scheduler's KV allocator, and the transfers handed pages and not committed."""

    def __init__(self, allocator: Any) -> None:
        self.allocator = allocator
        self.page_size = int(getattr(allocator, "page_size", 1) or 1)
        self.ledger = PageLedger(int(allocator.size) // self.page_size + 2, native=False)
        # room -> (owner, generation, pages), or the reason the pages could not be recorded
        self.transfers: OrderedDict[int, tuple[str, int, Any] | str] = OrderedDict()
        self.learning = LandingQueue()  # frees on their way to the host

    def publish(self, room: int, pages: Any) -> None:
        owner = f"room:{room}"
        self.apply_learned()
        try:
            generation = self._reserve(owner, pages)
            record: tuple[str, int, Any] | str = (owner, generation, pages)
        except LedgerError as exc:
            record = f"destination page not free in the page ledger when handed to the transfer: {exc}"
        self.transfers[room] = record
        self.transfers.move_to_end(room)
        while len(self.transfers) > MAX_OPEN_TRANSFERS:
            self.transfers.popitem(last=False)

    def _reserve(self, owner: str, pages: Any) -> int:
        try:
            return self.ledger.reserve_bulk(owner, pages, PageState.WRITING, handed_over=True)
        except LedgerError:
            if not self.learning:
                raise
        self.apply_learned(wait=True)  # a free not yet learned: wait for its copy (a rare host synchronisation)
        return self.ledger.reserve_bulk(owner, pages, PageState.WRITING, handed_over=True)

    def learn(self, index: Any) -> None:
        """The allocator took ``index`` (page numbers) back; the ledger learns of it once the copy lands."""
        if not hasattr(index, "detach"):  # already on the host
            self.release(_as_pages(index))
            return
        self.learning.add(HostCopy.launch([index]))
        self.apply_learned()

    def apply_learned(self, wait: bool = False) -> None:
        self.learning.drain(lambda pages: self.release(_as_pages(pages)), wait)

    def release(self, pages: Any) -> None:
        """Pages back on the allocator's free list: FREE in the ledger, whichever owner held them."""
        for owner, owned in self.ledger.owner_groups(pages):
            self.ledger.release_bulk(owner, owned, writer_drained=True)

    def refusal(self, req: Any, req_to_token: Any) -> str | None:
        """Why the request must not be decoded, or None: the transfer's pages are written, the page table (read
        now: a host synchronisation) is checked against the ledger."""
        rows = _as_pages(req_to_token[_pool_idx(req), : len(req.origin_input_ids)])
        prefix = getattr(req, "prefix_indices", None)
        decision = self.judge(req, rows, _as_pages(prefix) if prefix is not None and len(prefix) else None)
        return None if decision.allows else decision.reason

    def judge(self, req: Any, rows: Any, prefix: Any) -> Decision:
        """The transfer's pages are written; the request's page table ``rows`` (token slots, host) are checked
        against the ledger, its cached ``prefix`` slots allowed."""
        rid = str(req.rid)
        record = self.transfers.pop(int(req.bootstrap_room), None)
        if record is None or isinstance(record, str):
            reason = record or f"no record of the pages handed to the transfer of room {req.bootstrap_room}"
            return Decision(GUARD, Verdict.ABORT, f"request {rid}: {reason}", 500, {"rid": rid})
        owner, generation, pages = record
        self.ledger.move_bulk(owner, pages, PageState.WRITTEN)
        prefix_pages = [] if prefix is None else distinct(prefix // self.page_size).tolist()
        return check_page_table(self.ledger, owner, generation, distinct(rows // self.page_size).tolist(),
                                prefix_pages)


def _pool_idx(req: Any) -> int:
    kv = getattr(req, "kv", None)
    pool_idx = getattr(kv, "req_pool_idx", None) if kv is not None else None
    return int(pool_idx if pool_idx is not None else req.req_pool_idx)


class PageTagGateStep:
    """The commit gate's page-tag step: the request's page table row (and cached prefix) copied to pinned memory on
    a private stream when the transfer reports success, judged once it landed."""

    def launch(self, queue: Any, decode_req: Any) -> Any:
        req = decode_req.req
        row = queue.scheduler.req_to_token_pool.req_to_token[_pool_idx(req), : len(req.origin_input_ids)]
        prefix = getattr(req, "prefix_indices", None)
        tensors = [row] if prefix is None or len(prefix) == 0 else [row, prefix]
        return HostCopy.launch(tensors, side_stream(row.device) if on_accelerator(row) else None)

    def decide(self, _queue: Any, decode_req: Any, pending: Any) -> Decision | None:
        if not pending.ready():
            return None
        node = NODE
        if node is None:
            rid = str(decode_req.req.rid)
            return Decision(GUARD, Verdict.ABORT, f"request {rid}: no page ledger: no transfer was ever handed "
                            "pages in this process", 500, {"rid": rid})
        prefix = _as_pages(pending.numpy(1)) if len(pending) > 1 else None
        return node.judge(decode_req.req, _as_pages(pending.numpy(0)), prefix)


GATE_STEP = PageTagGateStep()


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
            node.learn(ids)


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
