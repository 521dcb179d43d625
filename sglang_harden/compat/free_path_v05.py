"""The page lifecycle's free path on SGLang 0.5.19 … 0.5.23, decided on the host without reading the freed index.

Every page SGLang frees passes the allocator's choke point (``TokenToKVPoolAllocator.free`` at page size 1,
``PagedTokenToKVPoolAllocator._release_page_ids`` above). The index it gets is a device tensor: reading it on the
host would stall the overlap scheduler for the rest of the forward in flight. So the free is judged by *why* SGLang
frees, which the hooks here record on the scheduler thread (a stack of contexts):

* ``release_kv_cache(req, …)`` (and the radix cache's caching of an unfinished request): the pages of one request.
  Decode: if that request's transfer may still write (reserved, not reported written), the ledger quarantines the
  transfer's pages from its own host copy of them (the page list SGLang already synced when it sent them) and the
  whole free is kept back, a device-side copy of the index, until the writer drains; otherwise it passes. Prefill:
  if the room's transfer has not settled (a chunk may still read the pages), the whole free waits for it.
* the radix cache's ``evict``: pages of finished requests. Decode: they pass. Prefill: they pass unless a room that
  SGLang already let go of still pins source pages (an abort with a chunk in flight, a failed write).
* ``free_group_end``: SGLang frees what it collected in the group; every part was judged when it was collected,
  except on the paged allocator (which collects before its choke point): there a group in which an in-flight
  request was released is read.
* anything else, or the cases above that say so: the index is read (one host synchronisation) and the ledger
  judges page by page, as on a CPU. Only while something is at risk: nothing in flight -> it passes.

Decode's ledger still learns of every free that passes: a copy of the index goes to pinned host memory without
blocking, and the ledger applies it when it lands (at the next reservation at the latest: SGLang's own read of
the new pages lands it first). A page found still being written there was freed outside every release the guard
can attribute; it is reported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from sglang_harden.compat.free_context import (
    EVICT,
    GROUP_FLUSH,
    HOLD,
    READ,
    REQUEST,
    VETTED,
    FreeContext,
    current,
    group_begins,
    group_flush_context,
    note_release,
    room_of,
    route,
    within,
)
from sglang_harden.compat.hooks import Hook
from sglang_harden.compat.internals import (
    ALLOC_BASE,
    ALLOC_PAGED,
    MEM_COMMON,
    PAGED_RELEASE,
    RADIX,
    TOKEN_FREE,
    UNIFIED_RADIX,
)
from sglang_harden.compat.lifecycle_nodes import DecodeNode, HeldFree
from sglang_harden.compat.prefill_node import PrefillNode
from sglang_harden.compat.runtime import RUNTIME
from sglang_harden.kernels.device import upload

Func = Callable[..., Any]

_node_source: list[Callable[[], DecodeNode | PrefillNode | None]] = []


def read_node_from(source: Callable[[], DecodeNode | PrefillNode | None]) -> None:
    """Where this process's lifecycle node is kept (``lifecycle_v05`` says so when it is imported)."""
    _node_source[:] = [source]


def _node() -> DecodeNode | PrefillNode | None:
    return _node_source[0]() if _node_source else None


# ---------------------------------------------------------------- where SGLang frees from


def _release_context(original: Func) -> Func:
    def release_kv_cache(req: Any, tree_cache: Any, *args: Any, **kwargs: Any) -> Any:
        node = _node()
        if node is None:
            return original(req, tree_cache, *args, **kwargs)
        note_release(node, req)
        return within(FreeContext(REQUEST, req), lambda: original(req, tree_cache, *args, **kwargs))

    return release_kv_cache


def _request_context(original: Func) -> Func:
    """A tree cache's method that frees pages of the request it is given (caching an unfinished request)."""

    def method(self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        if _node() is None:
            return original(self, req, *args, **kwargs)
        return within(FreeContext(REQUEST, req), lambda: original(self, req, *args, **kwargs))

    return method


def _evict_context(original: Func) -> Func:
    def evict(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _node() is None:
            return original(self, *args, **kwargs)
        return within(FreeContext(EVICT), lambda: original(self, *args, **kwargs))

    return evict


def _group_begin(original: Func) -> Func:
    def free_group_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        group_begins()
        return result

    return free_group_begin


def _group_end(original: Func) -> Func:
    def free_group_end(self: Any, *args: Any, **kwargs: Any) -> Any:
        context = group_flush_context()
        if context is None:  # the paged allocator's end calls the base class's: one flush context
            return original(self, *args, **kwargs)
        return within(context, lambda: original(self, *args, **kwargs))

    return free_group_end


# ---------------------------------------------------------------- the decision


def _hold(node: DecodeNode | PrefillNode, held: HeldFree) -> bool:
    """Keep ``held`` back for the request of the current context; False: nothing to keep (free it now)."""
    mode = RUNTIME.config.lifecycle
    room = room_of(current().req)
    if room is None:
        return False
    if isinstance(node, DecodeNode):
        transfer = node.in_flight(room)
        return transfer is not None and node.hold_release(transfer.owner, held, mode)
    return node.hold_free(room, held, mode)


def _pages_of(free_index: Any, page_size: int) -> np.ndarray:
    """The index read on the host (a host synchronisation for a device tensor: READ only)."""
    try:
        raw = free_index.numpy()  # index tensors never require grad; a CUDA tensor raises here
    except (TypeError, RuntimeError):
        raw = free_index.detach().cpu().numpy()
    arr = raw.astype(np.int64, copy=False)
    return arr // page_size if page_size > 1 else arr


def _read_and_judge(node: DecodeNode | PrefillNode, index: Any, release: Callable[[Any], Any],
                    token_scale: int) -> None:
    """The slow path: read ``index`` (page numbers), keep back what the ledger says may still be written or
    read, free the rest."""
    if isinstance(node, DecodeNode) and node.released_in_place(index):
        release(index)
        return
    pages = _pages_of(index, 1)
    keep = node.keep_back(pages, RUNTIME.config.lifecycle)
    if keep is None:
        release(index)
        return
    passed = np.flatnonzero(~keep)
    if passed.size:
        release(index.index_select(0, upload(passed, index)))
    if isinstance(node, DecodeNode):
        node.hold_pages(pages[keep], lambda kept: HeldFree(release, upload(kept, index, index.dtype),
                                                         int(kept.size) * token_scale))


def free_pages(node: DecodeNode | PrefillNode, index: Any, release: Callable[[Any], Any], token_scale: int,
               learned: bool = True) -> None:
    """The free of ``index`` (page numbers; ``token_scale`` tokens each) that ``release`` performs, judged."""
    action = route(node)
    if action == HOLD and _hold(node, HeldFree(release, index.clone(), int(index.numel()) * token_scale)):
        return
    if action == READ:
        _read_and_judge(node, index, release, token_scale)
        return
    release(index)
    if learned and isinstance(node, DecodeNode):
        node.learn(index)


def give_back(frees: list[HeldFree]) -> None:
    """Free what was kept back (the guard's own frees pass its choke points unjudged)."""
    for held in frees:
        within(FreeContext(VETTED), held.give_back)


def free_loose_pages(node: DecodeNode | PrefillNode, pages: list[int]) -> None:
    """Free pages the guard kept back by number (no kept-back free holds them): uploaded without blocking."""
    if not pages:
        return
    allocator = node.allocator
    like = allocator.free_pages if getattr(allocator, "free_pages", None) is not None else None
    if like is None:
        import torch

        index = torch.tensor(pages, dtype=torch.int64, device=allocator.device)
    else:
        index = upload(np.asarray(pages, dtype=np.int64), like, like.dtype)
    if node.page_size == 1:
        within(FreeContext(VETTED), lambda: allocator.free(index))
    else:
        within(FreeContext(VETTED), lambda: allocator._release_page_ids(index))


# ---------------------------------------------------------------- allocator choke points


def _token_free(original: Func) -> Func:
    def free(self: Any, free_index: Any) -> Any:
        node = _node()
        if node is None or self is not node.allocator or free_index.numel() == 0:
            return original(self, free_index)
        learned = current().kind != GROUP_FLUSH  # a group's parts were learned as they were collected
        free_pages(node, free_index, lambda index: original(self, index), 1, learned)
        return None

    return free


def _paged_release(original: Func) -> Func:
    def release_page_ids(self: Any, *page_ids: Any) -> Any:
        node = _node()
        if node is None or self is not node.allocator:
            return original(self, *page_ids)
        for ids in page_ids:
            if ids.numel():
                free_pages(node, ids, lambda index: original(self, index), node.page_size)
        return None

    return release_page_ids


def _tree_cache_hooks(module: str, cls: str) -> list[Hook]:
    """A radix tree cache's evictions, and its caching of an unfinished request (chunked prefill), which frees the
    pages its insert found cached already: cache_unfinished_req up to 0.5.21, checkpoint from 0.5.22."""
    return [
        Hook("lifecycle", module, f"{cls}.evict", ("self",), _evict_context),
        Hook("lifecycle", module, f"{cls}.cache_unfinished_req", ("self", "req"), _request_context, optional=True),
        Hook("lifecycle", module, f"{cls}.checkpoint", ("self", "req"), _request_context, optional=True),
    ]


HOOKS: list[Hook] = [
    Hook("lifecycle", *TOKEN_FREE, ("self", "free_index"), _token_free),
    Hook("lifecycle", *PAGED_RELEASE, ("self",), _paged_release),
    Hook("lifecycle", MEM_COMMON, "release_kv_cache", ("req", "tree_cache"), _release_context),
    Hook("lifecycle", ALLOC_BASE, "BaseTokenToKVPoolAllocator.free_group_begin", ("self",), _group_begin),
    Hook("lifecycle", ALLOC_BASE, "BaseTokenToKVPoolAllocator.free_group_end", ("self",), _group_end),
    Hook("lifecycle", ALLOC_PAGED, "PagedTokenToKVPoolAllocator.free_group_end", ("self",), _group_end),
    *_tree_cache_hooks(RADIX, "RadixCache"),
    *_tree_cache_hooks(UNIFIED_RADIX, "UnifiedRadixCache"),
    # the unified cache evicts for an allocation without going through its evict
    Hook("lifecycle", UNIFIED_RADIX, "UnifiedRadixCache.evict_for_alloc", ("self",), _evict_context),
]

# decode's page ledger for the page-tag guard (lifecycle off) needs the same free path
LEDGER_WRAPPERS = (_token_free, _paged_release, _release_context, _request_context, _evict_context, _group_begin,
                   _group_end)
