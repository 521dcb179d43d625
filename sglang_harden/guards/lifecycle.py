"""Page lifecycle guard: a KV page goes back to the free list only when no write into it can still land.

Invariant: a page that was handed to a writer is freed (decode) or reused as a transfer's source (prefill)
only once the writer drained: decode's writer acknowledged, is known gone, or never started
(:func:`writer_drained`); prefill's transfer of the room has no chunk outstanding, has ended, and no write it
gave up on can still land (:func:`source_settled`). Until then decode's pages wait in quarantine (a bare
timeout is no confirmation) and prefill's source pages stay held; and once the writer drained, nothing holds them
longer (SGLang's own deferred release of a failed transfer ends on the same evidence, not at its timeout).
Quarantine is bounded: at the cap the node stops admitting PD requests (HTTP 503) rather than reuse pages.
Transfers are cut into bounded windows.

Who owns which page, in which state, is the page ledger's (:mod:`.page_ledger`, re-exported here). The rules
below are the ones production runs (``compat/lifecycle_nodes.py``) and the protocol model explores
(``protocol/policies.py``). Residual risk: a write the transport gave up on is assumed not to land after
``transfer_write_lifetime_s`` (lifetime 0: only "sender gone" ends the wait); the model shows the
counterexample when a write outlives it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from sglang_harden.guards.page_ledger import (  # noqa: F401 - the ledger's names, used through this module
    GUARD,
    MIXED,
    NO_OWNER,
    NONE_TRACKED,
    NOT_HANDLED_HERE,
    RELEASED,
    LedgerError,
    LedgerSnapshot,
    PageLedger,
    PageState,
    ReleaseOutcome,
    default_quarantine_cap,
    distinct,
)


@dataclass(frozen=True)
class DrainEvidence:
    """What decode knows about the writers of one transfer into its pages."""

    required_acks: int  # prefill ranks that must each acknowledge that their writes drained
    acks: int  # acknowledgements received so far
    sender_gone: bool = False  # the writer's process is known to be gone (restarted, unreachable for good)
    never_started: bool = False  # prefill said it never queued a write for the room


def writer_drained(evidence: DrainEvidence) -> bool:
    """Whether no write into the transfer's pages can still land, so quarantine may end."""
    if evidence.sender_gone or evidence.never_started:
        return True
    return evidence.required_acks > 0 and evidence.acks >= evidence.required_acks


@dataclass(frozen=True)
class SourceEvidence:
    """What prefill knows about one room's transfer when the room's source pages are let go."""

    chunks_outstanding: int  # chunks queued or in flight on the transfer worker
    transfer_ended: bool  # the room's transfer status is final (success or failure) or unknown
    failed_write_age_s: float | None = None  # since the transport gave up on a write of the room; None: none did


def source_settled(evidence: SourceEvidence, write_lifetime_s: float) -> bool:
    """Whether the room's writes are over: its source pages may be reused and its drain ack may go out.
    A write the transport gave up on may still land for ``write_lifetime_s`` (0: until the sender is gone)."""
    age = evidence.failed_write_age_s
    if age is not None and (write_lifetime_s <= 0 or age < write_lifetime_s):
        return False
    return evidence.chunks_outstanding == 0 and evidence.transfer_ended


FAILED_WRITE_EXPIRED = math.inf  # a failed write's age once its lifetime is over (the model's expiry event)


def split_into_windows(pages: Sequence[int], window: int) -> list[list[int]]:
    """Cut a transfer into batches of at most ``window`` pages, so a wait for one to drain is bounded."""
    if window <= 0:
        raise ValueError(f"transfer window must be positive, got {window}")
    return [list(pages[i : i + window]) for i in range(0, len(pages), window)]
