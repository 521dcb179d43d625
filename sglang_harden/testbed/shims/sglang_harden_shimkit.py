"""Helpers the test-only shims share: wrap methods of an SGLang class once per process, append a JSON line to the
trace folder, add a section to ``/server_info``'s internal state, list the page ids in a KV allocator's free
lists."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

TRACE_DIR_ENV = "SGLANG_HARDEN_TESTBED_KVTRACE_DIR"


def wrap_methods_once(cls: type, marker: str, wrappers: Mapping[str, Callable[[Any], Any]]) -> None:
    """``cls.<name> = wrapper(cls.<name>)`` for each entry, unless ``marker`` says this class was done."""
    if getattr(cls, marker, False):
        return
    for name, wrap in wrappers.items():
        setattr(cls, name, wrap(getattr(cls, name)))
    setattr(cls, marker, True)


def reporting_state(key: str, report: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A wrapper for the scheduler's ``get_internal_state`` that adds ``report(scheduler)`` under ``key`` (what
    ``/server_info`` shows; a failing report shows its error and never takes the server down)."""

    def wrap(original: Any) -> Any:
        @functools.wraps(original)  # keeps sglang-harden's hook marks visible through this wrapper
        def get_internal_state(self: Any, recv_req: Any) -> Any:
            output = original(self, recv_req)
            state = getattr(output, "internal_state", None)
            if isinstance(state, dict):
                try:
                    state[key] = report(self)
                except Exception as exc:
                    state[key] = {"error": repr(exc)}
            return output

        return get_internal_state

    return wrap


def append_trace_line(stem: str, record: Mapping[str, Any]) -> None:
    """One JSON line to ``$SGLANG_HARDEN_TESTBED_KVTRACE_DIR/<stem>-<pid>.jsonl`` (nothing when it is unset)."""
    folder = os.environ.get(TRACE_DIR_ENV)
    if not folder:
        return
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    with (path / f"{stem}-{os.getpid()}.jsonl").open("a") as fh:
        fh.write(json.dumps(record) + "\n")


def free_page_ids(allocator: Any) -> list[int]:
    """Every page id in the allocator's free lists, recently released first: the pages released but not yet merged
    (``release_pages`` up to 0.5.2x, ``staged_pages`` later), then the free pages."""
    parts = [getattr(allocator, "release_pages", None), *(getattr(allocator, "staged_pages", None) or []),
             getattr(allocator, "free_pages", None)]
    return [int(x) for part in parts if part is not None and hasattr(part, "tolist") for x in part.tolist()]


def pool_idx(req: Any) -> int | None:
    """The request's row in SGLang's page table: ``req.kv.req_pool_idx`` (0.5.19+), else ``req.req_pool_idx``
    (0.4.x; 0.5.18, whose ``req.kv`` holds other things)."""
    idx = getattr(getattr(req, "kv", None), "req_pool_idx", None)
    return idx if idx is not None else getattr(req, "req_pool_idx", None)


def kv_layer_buffers(pool: Any) -> tuple[list[Any], list[Any]]:
    """Each layer's K and V buffer of a KV pool: MHA's own lists, or, on a pool without them (MLA's latent buffer),
    what the pool's getters answer per layer (views of the same memory)."""
    if getattr(pool, "k_buffer", None) is not None:
        return list(pool.k_buffer), list(pool.v_buffer)
    start = getattr(pool, "start_layer", 0) or 0
    layers = range(start, start + pool.layer_num)
    return [pool.get_key_buffer(i) for i in layers], [pool.get_value_buffer(i) for i in layers]
