"""numpy helpers over arrays of page numbers, for the page ledger's hot path (numpy is imported on first use)."""

from __future__ import annotations

from typing import Any


def numpy_module() -> Any:
    import numpy

    return numpy


_NO_PAGES: list[Any] = []


def no_pages() -> Any:
    """A shared empty int64 numpy array (nothing refused): cheaper than slicing the caller's array."""
    if not _NO_PAGES:
        np = numpy_module()
        empty = np.empty(0, dtype=np.int64)
        empty.flags.writeable = False
        _NO_PAGES.append(empty)
    return _NO_PAGES[0]


def distinct(pages: Any) -> Any:
    """The distinct values of an int numpy array, sorted (``numpy.unique`` without its per-call overhead, which
    dominates for the few hundred pages of one request)."""
    import numpy as np

    if pages.size < 2:
        return pages
    ordered = np.sort(pages)
    first = np.empty(ordered.size, dtype=bool)
    first[0] = True
    np.not_equal(ordered[1:], ordered[:-1], out=first[1:])
    return ordered if np.count_nonzero(first) == first.size else ordered[first]
