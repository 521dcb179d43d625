"""The properties the model checks on every transition and at quiesce, and the record of one violation."""

from __future__ import annotations

from dataclasses import dataclass

PROPERTIES = {
    "stale_read": "no stale read: a decode step never reads KV a page's previous owner left behind",
    "late_write_read": "no foreign read: a decode step never reads KV another request's late write put there",
    "source_reuse_read": "no foreign read: a transfer never carries KV from a prefill page reused under it",
    "unwritten_read": "no read of a page this request's transfer never wrote (uninitialised rows)",
    "double_free": "no page freed twice",
    "leak_at_quiesce": "no page leaked at quiesce (both pools full, quarantine empty)",
    "rejected_completed": "every rejected request gets an error and no completion",
    "rejected_allocated": "a node never bootstraps or allocates for a request it has already rejected",
    "aborted_pages_held": "every aborted request frees or quarantines all of its pages",
    "stuck_until_timeout": "nothing waits for a timeout: when only timeouts are enabled, all requests ended",
}


@dataclass(frozen=True)
class Violation:
    prop: str
    detail: str
