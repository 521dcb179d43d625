"""Canary guard: decode commits a transfer only if every page it reserved for that transfer was written.

Invariant: a page decode reserved for an incoming transfer is read by the request only after this
transfer wrote it. A reserved page still holding what it held before (the previous owner's KV: the stale
page of the incident) aborts the request before its first decode step. Cheap enough to stay on always; the
digest (:mod:`.checksum`) is the thorough byte check, this is the precise "page never written" one.

The evidence:

* **Stamp in a fixed slot** (memory truth, needs no cooperation from the sender). At reservation, decode
  writes a 64-bit marker into the first 8 bytes of one token row (head 0) of each reserved page, in a few
  chosen layer buffers (first layer K and last layer V catch transfers cut short at either end). A transfer
  writes whole pages, so it overwrites the marker; before commit, any reserved page whose slot still holds
  the marker was never written. The marker is a fresh 64-bit value per reservation (:func:`new_marker`), so a
  real KV row matches it with probability 2**-64 and an old stamp never reads as "written". Helpers:
  :func:`stamp`, :func:`still_stamped` (torch; CPU or CUDA).
  Ordering hazard: the stamp is a write into pages the sender will write. It must complete (stream
  synchronised, :func:`stamp` does it) *before* decode hands the page indices to prefill, and must never be
  re-applied to pages with a transfer in flight. Only pages freshly reserved for the transfer are stamped,
  never pages holding the request's cached prefix.

Relation to upstream ``--kv-canary`` (0.5.13+, default ``none``): upstream keeps separate per-token canary
buffers (token id, position, a chained hash, optionally a hash of the first bytes of layer-0 KV) written by
the model forward and verified before attention, and in PD splices those buffers into the transfer buffer
list (a head entry before the K layers, a tail after) so they travel with the KV; a reserved page the
transfer skipped keeps the previous owner's canary and fails the chain check at decode's forward. Its
verdict is per server (``log`` logs, ``raise`` fails the process), not a per-request abort before commit,
it costs extra memory and kernels, and pins before 0.5.13 lack it. Ours is per request, before commit, on
every pin, with no extra memory. They coexist: our stamp lives in the KV data rows, which the transfer
overwrites, not in upstream's canary buffers, and upstream's canary verifies rows written by forward, which
our stamp never touches after commit.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from sglang_harden.guards.base import Decision, Verdict, allow
from sglang_harden.kernels.digest_spec import mix64

GUARD = "canary"
ABORT_STATUS = 500
MAX_LISTED = 8

_counter = 0


def new_marker(rid: str = "") -> int:
    """A fresh nonzero 64-bit marker for one reservation (unique per process, unpredictable)."""
    global _counter
    _counter += 1
    value = mix64(int.from_bytes(os.urandom(8), "little") ^ hash(rid) ^ (_counter << 32) ^ os.getpid())
    return value or 1


# ------------------------------------------------------------------------------------------- decisions


def decide_commit(rid: str, reserved_pages: Sequence[int], unwritten_pages: Iterable[int]) -> Decision:
    """ALLOW when no reserved page is still unwritten; else ABORT naming (some of) the pages."""
    missing = sorted(set(unwritten_pages))
    fields: dict[str, object] = {"rid": rid, "reserved_pages": len(reserved_pages)}
    if not missing:
        return allow(GUARD, **fields)
    reason = (
        f"request {rid}: {len(missing)} of {len(reserved_pages)} reserved KV pages were never written by "
        f"its transfer (e.g. {missing[:MAX_LISTED]}); they still hold a previous owner's KV"
    )
    return Decision(
        GUARD,
        Verdict.ABORT,
        reason,
        ABORT_STATUS,
        {**fields, "unwritten_pages": missing[:MAX_LISTED], "unwritten_count": len(missing)},
    )


def stamp_slots(pages: Sequence[int], page_size: int, first_offset: int = 0) -> list[int]:
    """The token slot stamped in each page: its first sent token (``first_offset`` in the first page)."""
    return [page * page_size + (first_offset if i == 0 else 0) for i, page in enumerate(pages)]
