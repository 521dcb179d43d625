"""Page ownership tags on SGLang 0.5.19 … 0.5.23: before decode commits a transfer (a step of the commit gate,
``compat/commit_gate.py``), every prompt page in the request's page table must be owned, written, by this very
transfer's reservation (its cached prefix aside).

The page table row lives on the GPU: the gate copies it (and the request's cached prefix) into pinned memory on a
private stream when the transfer reports success, and this step judges the copy once it landed. The row was written
at preallocation, before SGLang's own read of the new pages there, so the copy needs no ordering after the forward
in flight. Reads decode's page ledger, which the lifecycle hooks keep (``compat/lifecycle_v05.py``; with the
lifecycle guard off its ledger-keeping hooks run for this guard alone). Decisions come from ``guards.page_tags``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sglang_harden import events
from sglang_harden.compat import commit_gate, free_path_v05, lifecycle_v05
from sglang_harden.compat.lifecycle_nodes import DecodeNode, Transfer
from sglang_harden.compat.runtime import RUNTIME
from sglang_harden.guards import lifecycle, page_tags
from sglang_harden.guards.base import Decision, Verdict, allow
from sglang_harden.kernels.device import HostCopy, on_accelerator, side_stream

TAGS_OK = allow(page_tags.GUARD)  # the hot path's ALLOW, made once (the log line carries the room / rid)
TAGS_OK_TALLY = events.Tally(TAGS_OK)


class PageTagStep:
    """The commit gate's page-tag step: copy the request's page table row (and cached prefix) to the host, then
    check it against the ledger."""

    def launch(self, queue: Any, decode_req: Any) -> Any:
        req = decode_req.req
        pool_idx = _pool_idx(req)
        length = len(req.origin_input_ids)
        if pool_idx is None or length <= 0:
            return None
        row = queue.scheduler.req_to_token_pool.req_to_token[pool_idx, :length]
        prefix = getattr(req, "prefix_indices", None)
        tensors = [row] if prefix is None or len(prefix) == 0 else [row, prefix]
        stream = side_stream(row.device) if on_accelerator(row) else None
        return HostCopy.launch(tensors, stream)

    def decide(self, _queue: Any, decode_req: Any, pending: Any) -> Decision | None:
        req = decode_req.req
        node = lifecycle_v05.NODE
        room = getattr(req, "bootstrap_room", None)
        if pending is not None and not pending.ready():
            return None
        transfer = node.finish(int(room)) if isinstance(node, DecodeNode) and room is not None else None
        if pending is None or transfer is None:
            return TAGS_OK
        prefix = pending.numpy(1) if len(pending) > 1 else None
        return check_rows(node, req, transfer, pending.numpy(0), prefix)


def check_rows(node: DecodeNode, req: Any, transfer: Transfer, rows: np.ndarray,
               prefix: np.ndarray | None) -> Decision:
    """Page tags over the request's page table row (prompt slots), its own cached prefix allowed."""
    rows = rows.astype(np.int64, copy=False)
    prefix_pages: list[int] = []
    if prefix is not None and prefix.size:
        prefix = prefix.astype(np.int64, copy=False)
        prefix_pages = lifecycle.distinct(prefix // node.page_size if node.page_size > 1 else prefix).tolist()
    elif node.ledger.all_owned_written(transfer.owner, transfer.generation, rows, node.page_size):
        return TAGS_OK
    pages = rows // node.page_size if node.page_size > 1 else rows
    return page_tags.check_page_table(node.ledger, transfer.owner, transfer.generation,
                                      lifecycle.distinct(pages).tolist(), prefix_pages)


def check_request_pages(node: DecodeNode, scheduler: Any, req: Any, transfer: Transfer) -> Decision:
    """:func:`check_rows` over the page table as it is now, read at once (tests and tools: a host synchronisation
    on a GPU)."""
    pool_idx = _pool_idx(req)
    length = len(req.origin_input_ids)
    if pool_idx is None or length <= 0:
        return allow(page_tags.GUARD, rid=str(req.rid), pages=0)
    rows = free_path_v05._pages_of(scheduler.req_to_token_pool.req_to_token[pool_idx, :length], 1)
    prefix = getattr(req, "prefix_indices", None)
    prefix_rows = free_path_v05._pages_of(prefix, 1) if prefix is not None and len(prefix) > 0 else None
    return check_rows(node, req, transfer, rows, prefix_rows)


def verify_page_tags(node: DecodeNode, scheduler: Any, req: Any, transfer: Transfer) -> Decision | None:
    """Check and count the page tags of a request; the decision when it must be aborted (tests and tools)."""
    decision = check_request_pages(node, scheduler, req, transfer)
    mode = RUNTIME.config.page_tags
    if decision is TAGS_OK:
        TAGS_OK_TALLY.bump(mode, room=transfer.room, rid=req.rid)
        return None
    if decision.verdict is Verdict.ALLOW:
        events.record(decision, mode, room=transfer.room, rid=req.rid)
        return None
    return decision if events.record(decision, mode, room=transfer.room, rid=req.rid) else None


def _pool_idx(req: Any) -> int | None:
    kv = getattr(req, "kv", None)
    idx = getattr(kv, "req_pool_idx", None) if kv is not None else None
    return idx if idx is not None else getattr(req, "req_pool_idx", None)


commit_gate.count_allows(TAGS_OK_TALLY)
HOOKS = commit_gate.hooks("page_tags", "page_tags", PageTagStep())
