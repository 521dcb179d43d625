"""Pool occupancy on ``/get_server_info`` for testbed servers, vanilla ones included (test-only).

Adds ``internal_states[i].testbed_pool`` = ``{"total", "available", "evictable", "duplicate_free_pages"}`` (tokens;
the last counts page ids that sit in the allocator's free lists more than once: each is a double free) to the
scheduler's internal-state answer, so that a test can see whether a node's KV allocator is back to full capacity
once it is quiet, and whether anything was freed twice. Read-only: it reads the allocator and the tree cache and
changes nothing. Hooks ``Scheduler.get_internal_state`` (present in every supported pin).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from sglang_harden_shimkit import free_page_ids, reporting_state, wrap_methods_once

from sglang_harden._importhook import when_imported


def duplicate_free_pages(allocator: Any) -> int:
    ids = free_page_ids(allocator)
    return len(ids) - len(set(ids))


def pool_numbers(scheduler: Any) -> dict[str, int]:
    tree_cache = getattr(scheduler, "tree_cache", None)
    allocator = scheduler.token_to_kv_pool_allocator
    return {
        "total": int(scheduler.max_total_num_tokens),
        "available": int(allocator.available_size()),
        "evictable": int(tree_cache.evictable_size()) if tree_cache is not None else 0,
        "duplicate_free_pages": duplicate_free_pages(allocator),
    }


def _patch_scheduler(module: ModuleType) -> None:
    report = reporting_state("testbed_pool", pool_numbers)
    wrap_methods_once(module.Scheduler, "_sglang_harden_poolreport", {"get_internal_state": report})


def install() -> None:
    when_imported("sglang.srt.managers.scheduler", _patch_scheduler)
