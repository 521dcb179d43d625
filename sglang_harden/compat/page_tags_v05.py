"""Page ownership tags on SGLang 0.5.19 … 0.5.23: after decode commits a transfer (the last step of
``compat/commit_chain.py``), every prompt page in the request's page table must be owned, written, by this very
transfer's reservation (its cached prefix aside).

Reads decode's page ledger, which the lifecycle hooks keep (``compat/lifecycle_v05.py``; with the lifecycle guard
off its ledger-keeping hooks run for this guard alone). Decisions come from ``guards.page_tags``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from sglang_harden import events
from sglang_harden.compat import commit_chain, lifecycle_v05
from sglang_harden.compat.hooks import Hook
from sglang_harden.compat.lifecycle_nodes import DecodeNode, Transfer
from sglang_harden.compat.runtime import RUNTIME
from sglang_harden.guards import lifecycle, page_tags
from sglang_harden.guards.base import Decision, allow

Func = lifecycle_v05.Func
TAGS_OK = allow(page_tags.GUARD)  # the hot path's ALLOW, made once (the log line carries the room / rid)
TAGS_OK_TALLY = events.Tally(TAGS_OK)


def _check_after_commit(queue: Any, decode_req: Any, context: dict[str, Any]) -> bool:
    """Commit-chain step, after SGLang's commit: check the page table against the transfer the ledger step
    finished (``context["transfer"]``)."""
    req = decode_req.req
    transfer = context.get("transfer")
    if transfer is None or _aborted(req):
        return False
    refused = verify_page_tags(lifecycle_v05.NODE, queue.scheduler, req, transfer)  # type: ignore[arg-type]
    if refused is None:
        return False
    from sglang.srt.disaggregation.utils import prepare_abort

    prepare_abort(req, "sglang-harden page ownership check failed: " + refused.reason,
                  status_code=refused.status_code or 500)
    return True


def verify_page_tags(node: DecodeNode, scheduler: Any, req: Any, transfer: Transfer) -> Decision | None:
    """Check and count the page tags of a committed request; the decision when it must be aborted."""
    decision = check_request_pages(node, scheduler, req, transfer)
    mode = RUNTIME.config.page_tags
    if decision is TAGS_OK:
        TAGS_OK_TALLY.bump(mode, room=transfer.room, rid=req.rid)
        return None
    return decision if events.record(decision, mode, room=transfer.room, rid=req.rid) else None


def check_request_pages(node: DecodeNode, scheduler: Any, req: Any, transfer: Transfer) -> Decision:
    """Page tags over the request's page table (prompt rows), its own cached prefix allowed."""
    pool_idx = _pool_idx(req)
    length = len(req.origin_input_ids)
    if pool_idx is None or length <= 0:
        return allow(page_tags.GUARD, rid=str(req.rid), pages=0)
    table = scheduler.req_to_token_pool.req_to_token
    prefix = getattr(req, "prefix_indices", None)
    prefix_pages: list[int] = []
    if prefix is not None and len(prefix) > 0:
        prefix_pages = lifecycle.distinct(lifecycle_v05._pages_of(prefix, node.page_size)).tolist()
    else:  # a page repeats per token in the table: fine here
        view = node.table_view
        if view is not None and view[0] is table:  # a CPU table: read in place
            owned = node.ledger.row_owned_written(transfer.owner, transfer.generation, view[1], pool_idx, length,
                                                  node.page_size)
        else:
            owned = node.ledger.all_owned_written(transfer.owner, transfer.generation,
                                                  _page_table_rows(node, table, pool_idx, length), node.page_size)
        if owned:
            return TAGS_OK
    rows = _page_table_rows(node, table, pool_idx, length).astype(np.int64)
    pages = rows // node.page_size if node.page_size > 1 else rows
    return page_tags.check_page_table(node.ledger, transfer.owner, transfer.generation,
                                      lifecycle.distinct(pages).tolist(), prefix_pages)


def _page_table_rows(node: DecodeNode, table: Any, pool_idx: int, length: int) -> np.ndarray:
    """``table[pool_idx, :length]`` as int numpy (the table's dtype); a CPU page table is read through a numpy
    view made once."""
    view = node.table_view
    if view is None or view[0] is not table:
        try:
            node.table_view = view = (table, table.numpy())
        except (TypeError, RuntimeError):  # a CUDA page table: read the row through torch
            return lifecycle_v05._pages_of(table[pool_idx, :length], 1)
    return view[1][pool_idx, :length]


def _pool_idx(req: Any) -> int | None:
    kv = getattr(req, "kv", None)
    idx = getattr(kv, "req_pool_idx", None) if kv is not None else None
    return idx if idx is not None else getattr(req, "req_pool_idx", None)


def _aborted(req: Any) -> bool:
    reason = getattr(req, "finished_reason", None)
    return reason is not None and type(reason).__name__ == "FINISH_ABORT"


HOOKS: list[Hook] = [commit_chain.hook("page_tags", "page_tags", _check_after_commit)]
