"""Why SGLang frees KV pages right now, so that the page lifecycle can judge a free without reading the freed index
on the host (a GPU synchronisation). Shared by the plugin (``compat/free_path_v05.py``) and the backport series
(bundled into its ``pd_lifecycle``), so both judge alike.

SGLang's scheduler thread marks where it frees from (a stack of :class:`FreeContext`, per thread):

* ``REQUEST``: the pages of one request (``release_kv_cache``, a tree cache caching an unfinished request);
* ``EVICT``: pages a radix tree cache evicts (finished requests' KV);
* ``GROUP_FLUSH``: a free group's collected frees (``tainted`` when a request whose pages may still be written was
  released in the group on an allocator that collects before the lifecycle's choke point);
* ``VETTED``: the guard's own frees of what it kept back.

:func:`route` turns the context and the node's records into the decision: ``PASS`` (free as asked), ``HOLD``
(keep the whole free back for the request of the context) or ``READ`` (read the index and judge page by page:
only while something is at risk and the free cannot be attributed). Decode nodes answer ``in_flight(room)`` and
``any_in_flight()``; prefill nodes ``free_of_room_is_safe(room)``, ``released_pages_pinned()`` and ``unsettled()``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

REQUEST, EVICT, GROUP_FLUSH, VETTED = "request", "evict", "group_flush", "vetted"
PASS, HOLD, READ = "pass", "hold", "read"


@dataclass(frozen=True)
class FreeContext:
    kind: str
    req: Any = None
    tainted: bool = False


NO_CONTEXT = FreeContext("none")


class _Contexts(threading.local):
    def __init__(self) -> None:
        self.stack: list[FreeContext] = []
        self.group_open = False  # between free_group_begin and free_group_end
        self.group_tainted = False  # a request released in the open group may still be written (paged only)


CONTEXTS = _Contexts()


def current() -> FreeContext:
    stack = CONTEXTS.stack
    return stack[-1] if stack else NO_CONTEXT


def within(context: FreeContext, call: Callable[[], Any]) -> Any:
    CONTEXTS.stack.append(context)
    try:
        return call()
    finally:
        CONTEXTS.stack.pop()


@contextmanager
def marked(context: FreeContext) -> Iterator[None]:
    CONTEXTS.stack.append(context)
    try:
        yield
    finally:
        CONTEXTS.stack.pop()


def room_of(req: Any) -> int | None:
    room = getattr(req, "bootstrap_room", None)
    return None if room is None else int(room)


def is_decode(node: Any) -> bool:
    return hasattr(node, "in_flight")


def route_request(node: Any, req: Any) -> str:
    room = room_of(req)
    if is_decode(node):
        return HOLD if node.in_flight(room) is not None else PASS
    return PASS if room is None or node.free_of_room_is_safe(room) else HOLD


def route(node: Any) -> str:
    """PASS, HOLD or READ for a free happening now (see the module's docstring)."""
    context = current()
    if context.kind == VETTED:
        return PASS
    if context.kind == REQUEST:
        return route_request(node, context.req)
    if context.kind == GROUP_FLUSH:
        return READ if context.tainted else PASS
    if is_decode(node):
        if context.kind == EVICT:
            return PASS
        return READ if node.any_in_flight() else PASS
    if context.kind == EVICT:
        return READ if node.released_pages_pinned() else PASS
    return READ if node.unsettled() else PASS


def note_release(node: Any, req: Any) -> None:
    """A request is released: in an open free group of a paged allocator, a hold taints the group's flush."""
    if node is not None and CONTEXTS.group_open and node.page_size > 1 and route_request(node, req) == HOLD:
        CONTEXTS.group_tainted = True


def group_begins() -> None:
    CONTEXTS.group_open, CONTEXTS.group_tainted = True, False


def group_flush_context() -> FreeContext | None:
    """The context of a free group's flush (None: no group open, e.g. the inner call of a subclass's flush)."""
    if not CONTEXTS.group_open:
        return None
    CONTEXTS.group_open = False
    return FreeContext(GROUP_FLUSH, tainted=CONTEXTS.group_tainted)
