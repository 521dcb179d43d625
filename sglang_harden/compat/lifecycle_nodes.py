"""The lifecycle rules' state on one SGLang 0.5.x scheduler process: :class:`DecodeNode` (the page ledger of the
destination pages and the drain evidence that arrives on other threads); prefill's side is
:class:`~sglang_harden.compat.prefill_node.PrefillNode`. The hooks that feed them are in :mod:`.lifecycle_v05`;
every decision comes from :mod:`sglang_harden.guards.lifecycle`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sglang_harden import events
from sglang_harden.compat.drain_ack import (
    expected_ack_ranks,
    failed_by_status,
    notice_generation,
    notice_sent,
    send_abort_notice,
)
from sglang_harden.compat.runtime import RUNTIME
from sglang_harden.config import Mode
from sglang_harden.guards import lifecycle
from sglang_harden.guards.base import Decision, Verdict, allow
from sglang_harden.guards.drain_acks import AckBook
from sglang_harden.guards.lifecycle import LedgerError, PageLedger, PageState
from sglang_harden.kernels.device import HostCopy, LandingQueue, on_accelerator

logger = logging.getLogger("sglang_harden")

NEVER_STARTED_MEMORY = 65536
PUBLISHED = allow(lifecycle.GUARD)  # made once: the ALLOW of a transfer's hot path
FREE = int(PageState.FREE)
WRITING = int(PageState.WRITING)
QUARANTINED = int(PageState.QUARANTINED)
_INDEX_WIDTHS: dict[Any, bool] = {}  # torch.int64 -> wide, torch.int32 -> not (filled on first use)


def owner_of_room(room: int) -> str:
    return f"room:{int(room)}"


def _index_width(tensor: Any) -> bool | None:
    """Whether an index tensor holds int64 (True) or int32 (False); None for any other dtype."""
    if not _INDEX_WIDTHS:
        import torch

        _INDEX_WIDTHS.update({torch.int64: True, torch.int32: False})
    return _INDEX_WIDTHS.get(tensor.dtype)


@dataclass(frozen=True)
class HeldFree:
    """A free SGLang asked for that the guard keeps back whole: the index tensor (a device-side copy: the guard
    never reads it on the host), the allocator call that frees it later, and how many KV tokens it holds."""

    release: Callable[[Any], Any]
    index: Any
    tokens: int

    def give_back(self) -> None:
        self.release(self.index)


# ---------------------------------------------------------------- decode node


@dataclass
class Transfer:
    """One request's transfer into this node: whose pages, which reservation, how many writers were notified
    (``required_acks``; which ranks those are and their acks: the node's :class:`AckBook`)."""

    owner: str
    room: int
    addr: str
    required_acks: int
    generation: int
    pages: np.ndarray
    receiver: Any = None
    written: bool = False  # the transfer reported success on this rank: no write into its pages can come


@dataclass
class DecodeNode:
    """Ledger of one decode scheduler process plus the drain evidence that arrives on other threads."""

    allocator: Any
    page_size: int
    cap: int
    ledger: PageLedger
    transfers: dict[str, Transfer] = field(default_factory=dict)
    by_room: dict[int, Transfer] = field(default_factory=dict)  # the same transfers, by room (the commit's key)
    acks: AckBook = field(default_factory=AckBook)  # the drain acks of the live transfers
    ignored_acks: int = 0  # written by the receiver thread only
    _gone: set[str] = field(default_factory=set)
    _never_started: dict[tuple[int, str], None] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    table_view: tuple[Any, np.ndarray] | None = None  # (req_to_token, its numpy view) when it lives on the CPU
    held: dict[str, list[HeldFree]] = field(default_factory=dict)  # owner -> frees kept back until it drains
    learning: LandingQueue = field(default_factory=LandingQueue)  # pages SGLang freed, on their way to the host

    @classmethod
    def for_allocator(cls, allocator: Any, cap: int) -> DecodeNode:
        page_size = int(getattr(allocator, "page_size", 1) or 1)
        num_pages = int(allocator.size) // page_size + 2
        node = cls(allocator, page_size, cap, PageLedger(num_pages))
        events.set_quarantined_pages(0, node.quarantine_cap)
        return node

    @property
    def states(self) -> np.ndarray:
        return self.ledger.state_array()

    @property
    def num_pages(self) -> int:
        return self.ledger.num_pages

    @property
    def quarantine_cap(self) -> int:
        """Quarantined pages at which the door closes (the ledger's admission rule, cap <= 0: its default)."""
        return self.cap if self.cap > 0 else lifecycle.default_quarantine_cap(self.ledger.num_pages)

    # ---- transfer path (scheduler thread)
    def begin(self, room: int, addr: str, required_acks: int, pages: np.ndarray, receiver: Any) -> Decision:
        """Reserve ``pages`` for the room's transfer, already handed to its writer. ``pages`` becomes the ledger's
        (the caller never changes it afterwards)."""
        owner = owner_of_room(room)
        self.apply_learned()
        try:
            generation = self._reserve(owner, pages)
        except LedgerError as exc:
            return Decision(lifecycle.GUARD, Verdict.ABORT, f"destination page not free: {exc}", 500,
                            {"room": room})
        self.transfers[owner] = self.by_room[room] = Transfer(owner, room, addr, required_acks, generation, pages,
                                                              receiver)
        opened = self.acks.open(room, expected_ack_ranks(receiver), notice_sent(receiver),
                                lambda: notice_generation(receiver))
        if not opened.allows:
            events.record(opened, RUNTIME.config.lifecycle)
        return PUBLISHED  # the caller's log line names the room

    def _reserve(self, owner: str, pages: np.ndarray) -> int:
        try:
            return self.ledger.reserve_bulk(owner, pages, PageState.WRITING, handed_over=True)
        except LedgerError:
            if not self.learning:
                raise
        # A page SGLang freed was handed out again before the copy that tells us of the free landed (SGLang's own
        # read of the new pages normally lands it first): wait for it. A host synchronisation, on this rare path.
        self.apply_learned(wait=True)
        return self.ledger.reserve_bulk(owner, pages, PageState.WRITING, handed_over=True)

    def finish(self, room: int) -> Transfer | None:
        transfer = self.by_room.get(room)
        if transfer is not None and not transfer.written:
            self.ledger.move_bulk(transfer.owner, transfer.pages, PageState.WRITTEN)
            transfer.written = True
        return transfer

    def in_flight(self, room: int | None) -> Transfer | None:
        """The room's transfer while a write into its pages may still come (reserved, not reported written)."""
        transfer = self.by_room.get(room) if room is not None else None
        return transfer if transfer is not None and not transfer.written else None

    def any_in_flight(self) -> bool:
        return any(not transfer.written for transfer in self.transfers.values())

    # ---- drain evidence (any thread)
    def note_ack(self, room: int, rank: int, generation: int | None = None) -> Decision:
        """Prefill's drain ack (receiver thread): counted only as :mod:`~sglang_harden.guards.drain_acks` says;
        every ack that is not is recorded and ignored."""
        decision = self.acks.note(room, rank, generation)
        if decision.verdict is not Verdict.ALLOW:  # a duplicate too (skipped)
            events.record(decision, RUNTIME.config.lifecycle, quiet=True)
            self.ignored_acks += 1
            if self.ignored_acks & (self.ignored_acks - 1) == 0:  # logged the 1st, 2nd, 4th, 8th ... time
                logger.warning("sglang-harden lifecycle: drain ack #%d ignored (room %s, rank %s): %s",
                               self.ignored_acks, room, rank, decision.reason)
        return decision

    def arm(self, receiver: Any) -> None:
        """``receiver`` is about to send its abort notice: acks of its transfer may come from now on."""
        room = getattr(receiver, "bootstrap_room", None)
        transfer = self.by_room.get(int(room)) if room is not None else None
        if transfer is not None and transfer.receiver is receiver:
            self.acks.arm(transfer.room)

    def note_gone(self, addr: str) -> None:
        with self._lock:
            self._gone.add(addr)

    def note_never_started(self, room: int, addr: str) -> None:
        """Prefill at ``addr`` refused ``room`` before any sender existed: no write to its pages can come."""
        with self._lock:
            self._never_started[(int(room), addr)] = None
            while len(self._never_started) > NEVER_STARTED_MEMORY:
                self._never_started.pop(next(iter(self._never_started)))

    def drained(self, owner: str) -> bool:
        transfer = self.transfers.get(owner)
        if transfer is None:
            return False
        if failed_by_status(transfer.receiver):  # acks prefill sent with its failure count now
            self.acks.sender_failed(transfer.room)
        acked = self.acks.count(transfer.room)
        with self._lock:  # a transfer whose targets are unknown (required 0) waits for its sender to be gone
            evidence = lifecycle.DrainEvidence(
                max(transfer.required_acks, acked.required), acked.acked, transfer.addr in self._gone,
                (transfer.room, transfer.addr) in self._never_started)
        return lifecycle.writer_drained(evidence)

    # ---- free path (scheduler thread)
    def keep_back(self, pages: np.ndarray, mode: Mode) -> np.ndarray | None:
        """Mask of ``pages`` that must not reach the free list (None: free them all)."""
        if mode is Mode.ENFORCE and self._usual_free_done(*self.ledger.release_unwritable(pages)):
            return None
        groups = self.ledger.owner_groups(pages)
        if not groups:
            return None
        for owner, owned in groups:
            self._release(owner, owned, mode)
        if self.ledger.quarantined_count() == 0:
            return None
        held = self.states[pages] == QUARANTINED
        return held if held.any() else None

    def released_in_place(self, free_index: Any) -> bool:
        """Enforce mode's usual free (one request's pages, none still writable, or none tracked) in one native
        call over a CPU index tensor's own memory, without making a numpy array of it. False: nothing changed,
        the caller runs :meth:`keep_back`."""
        if RUNTIME.config.lifecycle is not Mode.ENFORCE or self.page_size != 1 or on_accelerator(free_index):
            return False
        wide = _index_width(free_index)
        if wide is None or not free_index.is_contiguous():
            return False
        return self._usual_free_done(*self.ledger.release_unwritable_at(free_index.data_ptr(), free_index.numel(),
                                                                        wide))

    def _usual_free_done(self, found: int, owner: str | None) -> bool:
        """After a usual-case release (one request's unwritable pages, or none tracked): True when it took the
        whole free, the finished transfer's bookkeeping dropped once its pages are all gone."""
        if found == lifecycle.RELEASED:
            if owner is not None and self._all_free(owner):
                self._forget(owner)
            return True
        return found == lifecycle.NONE_TRACKED

    def _release(self, owner: str, pages: np.ndarray, mode: Mode) -> None:
        drained = self.drained(owner)
        if mode is not Mode.ENFORCE and not drained:
            would_hold = self._still_writing(owner, pages)
            if would_hold:
                self._record_quarantine(owner, would_hold, mode)
            drained = True
        outcome = self.ledger.release_bulk(owner, pages, writer_drained=drained)
        if len(outcome.to_quarantine):
            self._record_quarantine(owner, outcome.to_quarantine.tolist(), mode)
            self._ask_for_drain_ack(owner)
        elif self._all_free(owner):
            self._forget(owner)

    def _still_writing(self, owner: str, pages: np.ndarray) -> list[int]:
        """The pages of ``pages`` that ``owner`` holds and a writer may still write: what enforce would
        quarantine (log mode reports these and holds nothing)."""
        writing = pages[self.states[pages] == WRITING]
        if not writing.size:
            return []
        owner_ids = self.ledger.owner_ids_of(writing).tolist()
        return [page for page, owner_id in zip(writing.tolist(), owner_ids, strict=True)
                if self.ledger.owner_name(owner_id) == owner]

    def _all_free(self, owner: str) -> bool:
        return owner in self.transfers and not self.ledger.holds_pages(owner)

    def _record_quarantine(self, owner: str, pages: list[int], mode: Mode) -> None:
        transfer = self.transfers.get(owner)
        reason = (f"{len(pages)} KV pages of {owner} released while its transfer may still write them; "
                  "held in quarantine until the writer drains")
        decision = Decision(lifecycle.GUARD, Verdict.QUARANTINE, reason, None,
                            {"owner": owner, "pages": len(pages), "quarantined_total": self.ledger.quarantined_count(),
                             "addr": transfer.addr if transfer else None})
        events.record(decision, mode)
        events.set_quarantined_pages(self.ledger.quarantined_count(), self.quarantine_cap)

    def _ask_for_drain_ack(self, owner: str) -> None:
        """Prefill acknowledges a drained room only after an ABORT from us: make sure one went out."""
        transfer = self.transfers.get(owner)
        if transfer is None:
            return
        self.acks.arm(transfer.room)  # before the notice: its ack may come back at once
        try:
            send_abort_notice(transfer.receiver)
        except Exception as exc:  # noqa: BLE001 - best effort: without an ack the pages stay quarantined
            logger.warning("sglang-harden lifecycle: could not ask prefill to ack room %s: %r", transfer.room, exc)

    def _forget(self, owner: str) -> None:
        transfer = self.transfers.pop(owner, None)
        if transfer is not None:
            self.by_room.pop(transfer.room, None)
            self.acks.close(transfer.room)
            with self._lock:
                self._never_started.pop((transfer.room, transfer.addr), None)

    # ---- frees decided without reading the index (scheduler thread)
    def hold_release(self, owner: str, held: HeldFree, mode: Mode) -> bool:
        """SGLang releases ``owner``'s request while its transfer may still write: the ledger quarantines the
        transfer's pages (from its own host copy of them) and the whole free is kept back until the writer
        drains. False: nothing to keep (the writer drained already, or log mode): the caller frees now."""
        transfer = self.transfers.get(owner)
        if transfer is None:
            return False
        self._release(owner, transfer.pages, mode)
        if mode is not Mode.ENFORCE or owner not in self.ledger.quarantined_owners():
            return False
        self.held.setdefault(owner, []).append(held)
        return True

    def hold_pages(self, pages: np.ndarray, make: Callable[[np.ndarray], HeldFree]) -> None:
        """Pages the ledger quarantined on a free it read (``keep_back``): kept back by owner, ``make(pages)``
        turning each owner's pages into the free that gives them back later."""
        owner_ids = self.ledger.owner_ids_of(pages)
        for owner_id in lifecycle.distinct(owner_ids).tolist():
            owner = self.ledger.owner_name(owner_id)
            if owner is not None:
                self.held.setdefault(owner, []).append(make(pages[owner_ids == owner_id]))

    def learn(self, index: Any) -> None:
        """SGLang freed ``index`` (page numbers) without the guard reading it: the ledger learns of it once the
        copy lands on the host (:meth:`apply_learned`)."""
        if index.numel():
            self.learning.add(HostCopy.launch([index]))
            self.apply_learned()  # a host index is there at once

    def apply_learned(self, wait: bool = False) -> None:
        """Bring the ledger up to date with the frees whose copies landed (in order; ``wait``: all of them, a host
        synchronisation). A page found still being written was freed outside any release the guard can attribute:
        it is too late to keep it back, and that is reported loudly."""
        self.learning.drain(lambda pages: self._learn_freed(pages.astype(np.int64, copy=False)), wait)

    def _learn_freed(self, pages: np.ndarray) -> None:
        if self._usual_free_done(*self.ledger.release_unwritable(pages)):
            return
        for group_owner, owned in self.ledger.owner_groups(pages):
            writing = self._still_writing(group_owner, owned)
            if writing:
                decision = Decision(lifecycle.GUARD, Verdict.ABORT, f"{len(writing)} KV pages of {group_owner} were "
                                    "freed outside a request's release while its transfer may still write them",
                                    None, {"owner": group_owner, "pages": len(writing)})
                events.record(decision, Mode.LOG)
            self.ledger.release_bulk(group_owner, owned, writer_drained=True)
            if self._all_free(group_owner):
                self._forget(group_owner)

    # ---- leaving quarantine (scheduler thread)
    def confirmations(self) -> tuple[list[HeldFree], list[int]]:
        """The frees kept back for writers that drained or are gone since the last call, and the quarantined pages
        of those writers no kept-back free holds: both may go to the free list now (the loop hook calls this only
        while something is quarantined)."""
        given_back: list[HeldFree] = []
        loose: list[int] = []
        for owner in self.ledger.quarantined_owners():
            if self.drained(owner):
                pages = self.ledger.confirm_drained(owner)
                held = self.held.pop(owner, None)
                if held is None:
                    loose.extend(pages)
                else:
                    given_back.extend(held)
                decision = Decision(lifecycle.GUARD, Verdict.RELEASE, "writer drained", None,
                                    {"owner": owner, "pages": len(pages)})
                events.record(decision, Mode.ENFORCE)
                self._forget(owner)
        if given_back or loose:
            events.set_quarantined_pages(self.ledger.quarantined_count(), self.quarantine_cap)
        return given_back, loose

    def held_tokens(self) -> int:
        """KV tokens SGLang freed that are not on its free list: the frees kept back, and quarantined pages no
        kept-back free holds."""
        kept = sum(held.tokens for frees in self.held.values() for held in frees)
        loose = sum(len(self.ledger.quarantined_pages(owner)) for owner in self.ledger.quarantined_owners()
                    if owner not in self.held)
        return kept + loose * self.page_size

    def report(self) -> dict[str, Any]:
        cap = self.quarantine_cap
        return {
            "role": "decode",
            "page_size": self.page_size,
            "quarantined_pages": self.ledger.quarantined_count(),
            "quarantine_cap_pages": cap,
            "admission_open": self.ledger.quarantined_count() < cap,
            "tracked_transfers": len(self.transfers),
            "drain_ack_rooms": len(self.acks),
            "pages_not_free_in_ledger": int(np.count_nonzero(self.states != FREE)),
            "frees_kept_back": sum(len(frees) for frees in self.held.values()),
            "frees_not_yet_learned": len(self.learning),
        }


# ---------------------------------------------------------------- prefill node


@dataclass(frozen=True)
class _Poll:
    failed: Any
    success: Any
    ended: tuple[Any, ...]


_POLL: list[_Poll] = []


def _kv_poll() -> _Poll:
    """SGLang's transfer states this module compares against (imported once, on first use)."""
    if not _POLL:
        from sglang.srt.disaggregation.base.conn import KVPoll

        _POLL.append(_Poll(KVPoll.Failed, KVPoll.Success, (KVPoll.Success, KVPoll.Failed)))
    return _POLL[0]
