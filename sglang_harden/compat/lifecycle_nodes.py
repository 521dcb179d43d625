"""The lifecycle rules' state on one SGLang 0.5.x scheduler process: :class:`DecodeNode` (the page ledger of the
destination pages and the drain evidence that arrives on other threads) and :class:`PrefillNode` (the source pages
held per room until the room settled). The hooks that feed them are in :mod:`.lifecycle_v05`; every decision comes
from :mod:`sglang_harden.guards.lifecycle`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sglang_harden import events
from sglang_harden.compat.runtime import RUNTIME
from sglang_harden.config import Mode
from sglang_harden.guards import lifecycle
from sglang_harden.guards.base import Decision, Verdict, allow
from sglang_harden.guards.lifecycle import LedgerError, PageLedger, PageState

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


# ---------------------------------------------------------------- decode node


@dataclass
class Transfer:
    """One request's transfer into this node: whose pages, which reservation, which writers must ack."""

    owner: str
    room: int
    addr: str
    required_acks: int
    generation: int
    pages: np.ndarray
    receiver: Any = None


@dataclass
class DecodeNode:
    """Ledger of one decode scheduler process plus the drain evidence that arrives on other threads."""

    allocator: Any
    page_size: int
    cap: int
    ledger: PageLedger
    transfers: dict[str, Transfer] = field(default_factory=dict)
    by_room: dict[int, Transfer] = field(default_factory=dict)  # the same transfers, by room (the commit's key)
    _acks: dict[int, set[int]] = field(default_factory=dict)
    _gone: set[str] = field(default_factory=set)
    _never_started: dict[tuple[int, str], None] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    table_view: tuple[Any, np.ndarray] | None = None  # (req_to_token, its numpy view) when it lives on the CPU

    @classmethod
    def for_allocator(cls, allocator: Any, cap: int) -> DecodeNode:
        page_size = int(getattr(allocator, "page_size", 1) or 1)
        num_pages = int(allocator.size) // page_size + 2
        return cls(allocator, page_size, cap, PageLedger(num_pages))

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
        try:
            generation = self.ledger.reserve_bulk(owner, pages, PageState.WRITING, handed_over=True)
        except LedgerError as exc:
            return Decision(lifecycle.GUARD, Verdict.ABORT, f"destination page not free: {exc}", 500,
                            {"room": room})
        self.transfers[owner] = self.by_room[room] = Transfer(owner, room, addr, required_acks, generation, pages,
                                                              receiver)
        return PUBLISHED  # the caller's log line names the room

    def finish(self, room: int) -> Transfer | None:
        transfer = self.by_room.get(room)
        if transfer is not None:
            self.ledger.move_bulk(transfer.owner, transfer.pages, PageState.WRITTEN)
        return transfer

    # ---- drain evidence (any thread)
    def note_ack(self, room: int, rank: int) -> None:
        with self._lock:
            self._acks.setdefault(int(room), set()).add(int(rank))

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
        with self._lock:
            evidence = lifecycle.DrainEvidence(
                transfer.required_acks, len(self._acks.get(transfer.room, ())), transfer.addr in self._gone,
                (transfer.room, transfer.addr) in self._never_started)
        return lifecycle.writer_drained(evidence)

    # ---- free path (scheduler thread)
    def keep_back(self, pages: np.ndarray, mode: Mode) -> np.ndarray | None:
        """Mask of ``pages`` that must not reach the free list (None: free them all)."""
        if mode is Mode.ENFORCE and self._usual_free_done(*self.ledger.release_unwritable(pages)):
            return None
        sole = self.ledger.sole_owner(pages)
        if sole == lifecycle.NONE_TRACKED:
            return None
        if sole != lifecycle.MIXED:  # the usual case: one request's pages
            groups = [(sole, pages)]
        else:
            tracked_pages = pages[self.states[pages] != FREE]
            owner_ids = self.ledger.owner_ids_of(tracked_pages)
            groups = [(o, tracked_pages[owner_ids == o]) for o in lifecycle.distinct(owner_ids).tolist()]
        for owner_id, owned in groups:
            owner = self.ledger.owner_name(owner_id)
            if owner is not None:
                self._release(owner, owned, mode)
        if self.ledger.quarantined_count() == 0:
            return None
        held = self.states[pages] == QUARANTINED
        return held if held.any() else None

    def released_in_place(self, free_index: Any) -> bool:
        """Enforce mode's usual free (one request's pages, none still writable, or none tracked) in one native
        call over a CPU index tensor's own memory, without making a numpy array of it. False: nothing changed,
        the caller runs :meth:`keep_back`."""
        if RUNTIME.config.lifecycle is not Mode.ENFORCE or self.page_size != 1 or not free_index.is_cpu:
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
        events.set_quarantined_pages(self.ledger.quarantined_count())

    def _ask_for_drain_ack(self, owner: str) -> None:
        """Prefill acknowledges a drained room only after an ABORT from us: make sure one went out."""
        transfer = self.transfers.get(owner)
        receiver = transfer.receiver if transfer else None
        if receiver is None or getattr(receiver, "abort_notified", True):
            return
        try:
            ensure = getattr(receiver, "ensure_abort_notified", None)
            if ensure is not None:
                ensure(force_arm=True)
            elif getattr(receiver, "bootstrap_infos", None):
                receiver._send_abort_notification()
                receiver.abort_notified = True
        except Exception as exc:  # noqa: BLE001 - best effort: without an ack the pages stay quarantined
            logger.warning("sglang-harden lifecycle: could not ask prefill to ack room %s: %r", transfer.room, exc)

    def _forget(self, owner: str) -> None:
        transfer = self.transfers.pop(owner, None)
        if transfer is not None:
            self.by_room.pop(transfer.room, None)
            with self._lock:
                self._acks.pop(transfer.room, None)
                self._never_started.pop((transfer.room, transfer.addr), None)

    # ---- leaving quarantine (scheduler thread)
    def confirmations(self) -> list[int]:
        """Pages whose writer drained or is gone since the last call: they may go to the free list now (the loop
        hook calls this only while something is quarantined)."""
        freed: list[int] = []
        for owner in self.ledger.quarantined_owners():
            if self.drained(owner):
                pages = self.ledger.confirm_drained(owner)
                freed.extend(pages)
                decision = Decision(lifecycle.GUARD, Verdict.RELEASE, "writer drained", None,
                                    {"owner": owner, "pages": len(pages)})
                events.record(decision, Mode.ENFORCE)
                self._forget(owner)
        if freed:
            events.set_quarantined_pages(self.ledger.quarantined_count())
        return freed

    def held_tokens(self) -> int:
        return self.ledger.quarantined_count() * self.page_size

    def report(self) -> dict[str, Any]:
        cap = self.quarantine_cap
        return {
            "role": "decode",
            "page_size": self.page_size,
            "quarantined_pages": self.ledger.quarantined_count(),
            "quarantine_cap_pages": cap,
            "admission_open": self.ledger.quarantined_count() < cap,
            "tracked_transfers": len(self.transfers),
            "pages_not_free_in_ledger": int(np.count_nonzero(self.states != FREE)),
        }


# ---------------------------------------------------------------- prefill node


@dataclass
class PrefillNode:
    """Source pages of transfers that have not settled yet, on one prefill scheduler process. Its ledger is one
    column, ``held_room`` (page -> the room whose transfer reads it, 0: none), plus each room's page arrays.

    Per-room facts sit in one table per fact, keyed by room, because different threads write them: the scheduler
    ``holds`` and ``pending``, transfer workers ``failed_writes``, workers and the bootstrap thread
    ``stashed_acks`` and ``orphan_targets``; only the scheduler removes. Each write is one dict operation (atomic
    under the GIL). One record per room would need a lock around its creation and removal: a record dropped as
    settled while a worker marks its failed write would lose the mark, and the pages would go free while the write
    may still land."""

    allocator: Any
    page_size: int
    num_pages: int
    held_room: np.ndarray
    kv_mgr: Any = None
    holds: dict[int, list[np.ndarray]] = field(default_factory=dict)  # room -> its source page arrays
    pending: dict[int, list[int]] = field(default_factory=dict)
    failed_writes: dict[int, float] = field(default_factory=dict)
    stashed_acks: dict[int, list[Callable[[], Any]]] = field(default_factory=dict)
    orphan_targets: dict[int, Any] = field(default_factory=dict)
    lifetime_s: float = 30.0
    _sources_cache: dict[int, tuple[int, np.ndarray]] = field(default_factory=dict)

    @classmethod
    def for_allocator(cls, allocator: Any) -> PrefillNode:
        page_size = int(getattr(allocator, "page_size", 1) or 1)
        num_pages = int(allocator.size) // page_size + 2
        return cls(allocator, page_size, num_pages, np.zeros(num_pages, dtype=np.int64))

    def hold(self, kv_mgr: Any, room: int, pages: np.ndarray) -> None:
        """Hold ``pages`` (an int64 array that becomes the node's) until ``room``'s transfer settles."""
        self.kv_mgr = kv_mgr
        self.holds.setdefault(room, []).append(pages)
        self.held_room[pages] = room

    def note_failed_write(self, rooms: Sequence[int]) -> None:
        """The transport gave up on a write of these rooms: its bytes may still land for ``lifetime_s``."""
        now = time.monotonic()
        for room in rooms:
            self.failed_writes[int(room)] = now

    def failed_without_write_in_flight(self, room: int) -> bool:
        """Called by the transfer worker that fails ``room``: no write of the room can still land. Mooncake's
        writes are synchronous on the worker that fails the room (it dequeued the room's only chunk in flight),
        so only a write the transport gave up on (:meth:`note_failed_write`) may still land."""
        return room not in self.failed_writes

    def write_may_land(self, room: int) -> bool:
        """A failed write of ``room`` may still land (within its lifetime; lifetime 0: until the sender is gone)."""
        failed_at = self.failed_writes.get(room)
        return failed_at is not None and (self.lifetime_s <= 0 or time.monotonic() - failed_at < self.lifetime_s)

    def stuck_tokens(self) -> int:
        """Tokens of source pages that a transfer still pins after SGLang let go of them, not yet through the free
        path: they sit in the prefix cache, where SGLang counts them as evictable, but evicting them frees nothing.
        The allocator reports them as not available, so admission stops promising them. Two kinds of room pin
        them: one whose write failed (its bytes may land for the write lifetime), and one SGLang failed (an abort)
        while the transfer worker still reads a chunk of it."""
        rooms = self._rooms_pinning_released_pages()
        if not rooms:
            return 0
        stuck = 0
        for room in rooms:
            held = int(np.count_nonzero(self.held_room[self._distinct_sources(room)] == room))
            stuck += max(0, held - len(self.pending.get(room, ())))
        return stuck * self.page_size

    def _rooms_pinning_released_pages(self) -> set[int]:
        rooms = {room for room in self.failed_writes if self.write_may_land(room)}
        rooms.update(self._failed_rooms_still_read())
        return {room for room in rooms if room in self.holds}

    def _failed_rooms_still_read(self) -> list[int]:
        """Rooms SGLang failed (and so released) while a chunk of theirs is still queued or in flight."""
        mgr = self.kv_mgr
        outstanding = getattr(mgr, "_staging_outstanding", None)
        if not outstanding:
            return []
        failed = _kv_poll().failed
        return [room for room, chunks in list(outstanding.items())
                if chunks > 0 and mgr.request_status.get(room) == failed]

    def pins_released_pages(self) -> bool:
        """Cheap test before :meth:`stuck_tokens` (asked on every admission check)."""
        return bool(self.failed_writes) or bool(getattr(self.kv_mgr, "_staging_outstanding", None))

    def _distinct_sources(self, room: int) -> np.ndarray:
        """The room's source pages, each once (cached: the admission budget asks on every scheduler step while a
        failed write may land, and a room's holds only grow)."""
        arrays = self.holds[room]
        cached = self._sources_cache.get(room)
        if cached is None or cached[0] != len(arrays):
            cached = (len(arrays), lifecycle.distinct(np.concatenate(arrays)))
            self._sources_cache[room] = cached
        return cached[1]

    def settled(self, room: int) -> bool:
        """The guard's rule (``lifecycle.source_settled``) on what this process knows of the room's transfer."""
        failed_at = self.failed_writes.get(room)
        age = None if failed_at is None else time.monotonic() - failed_at
        mgr = self.kv_mgr
        if mgr is None:
            evidence = lifecycle.SourceEvidence(0, True, age)
        else:
            status = mgr.request_status.get(room)
            evidence = lifecycle.SourceEvidence(getattr(mgr, "_staging_outstanding", {}).get(room, 0),
                                                status is None or status in _kv_poll().ended, age)
        if not lifecycle.source_settled(evidence, self.lifetime_s):
            return False
        if failed_at is not None:
            del self.failed_writes[room]  # its lifetime is over
        return True

    def keep_back(self, pages: np.ndarray, mode: Mode) -> np.ndarray | None:
        """Mask of ``pages`` whose transfer has not settled (None: free them all); settled rooms let go."""
        rooms = self.held_room[pages]
        held = np.count_nonzero(rooms)  # 0: held by no room
        if held == 0:
            return None
        room = int(rooms.max())
        if room > 0 and held == np.count_nonzero(rooms == room) and self.settled(room):
            self._settle(room)  # the usual case: one room's sources, its transfer done
            return None
        return self._keep_unsettled(pages, rooms, mode)

    def _keep_unsettled(self, pages: np.ndarray, rooms: np.ndarray, mode: Mode) -> np.ndarray | None:
        keep = np.zeros(pages.shape, dtype=bool)
        for room in lifecycle.distinct(rooms[rooms != 0]).tolist():
            mine = rooms == room
            if self.settled(room):
                self._settle(room)
                continue
            decision = Decision(lifecycle.GUARD, Verdict.QUARANTINE,
                                f"source pages of room {room} freed before its transfer settled; held", None,
                                {"room": room, "pages": int(mine.sum())})
            if events.record(decision, mode):
                keep |= mine
                self.pending.setdefault(room, []).extend(pages[mine].tolist())
        return keep if keep.any() else None

    def _settle(self, room: int) -> None:
        self._sources_cache.pop(room, None)
        for pages in self.holds.pop(room, ()):
            self.held_room[pages[self.held_room[pages] == room]] = 0

    def settle_pending(self) -> list[int]:
        for room in [r for r in self.failed_writes if not self.write_may_land(r)]:
            del self.failed_writes[room]
        freed: list[int] = []
        for room in [r for r in self.pending if self.settled(r)]:
            freed.extend(self.pending.pop(room))
            self._settle(room)
        for room in [r for r in list(self.orphan_targets) if self.settled(r)]:  # the bootstrap thread adds
            _send_orphan_ack(self.kv_mgr, room, self.orphan_targets.pop(room))
            events.record(Decision(lifecycle.GUARD, Verdict.RELEASE, "drain ack SGLang dropped, sent once the room "
                                   "settled", None, {"room": room}), Mode.ENFORCE)
        for room in [r for r in self.stashed_acks if self.settled(r)]:
            for send in self.stashed_acks.pop(room):
                send()
            events.record(Decision(lifecycle.GUARD, Verdict.RELEASE, "drain ack sent after the write settled",
                                   None, {"room": room}), Mode.ENFORCE)
        return freed

    def busy(self) -> bool:
        return bool(self.pending or self.stashed_acks or self.failed_writes or self.orphan_targets)

    def held_tokens(self) -> int:
        """Tokens kept back from the free list plus those :meth:`stuck_tokens` hides from the allocator's count."""
        pending = sum(len(p) for p in self.pending.values()) * self.page_size if self.pending else 0
        return pending + self.stuck_tokens()

    def report(self) -> dict[str, Any]:
        return {
            "role": "prefill",
            "page_size": self.page_size,
            "source_pages_held_back": sum(len(p) for p in self.pending.values()),
            "rooms_unsettled": len(self.pending),
            "drain_acks_withheld": sum(len(a) for a in self.stashed_acks.values()),
            "ack_targets_kept_past_clear": len(self.orphan_targets),
            "rooms_with_failed_writes": len(self.failed_writes),
            "cached_tokens_pinned_by_failed_writes": self.stuck_tokens(),
        }


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


def _send_orphan_ack(mgr: Any, room: int, target: Any) -> None:
    """The drain ack whose target SGLang's sender.clear() dropped while the room was still being written."""
    try:
        if isinstance(target, tuple):  # 0.5.19/0.5.20: (decode_ip, decode_port)
            mgr._send_abort_ack(target[0], target[1], room)
        else:  # 0.5.21+: {(ip, port): AckTarget}
            mgr._send_abort_acks(room, target)
    except Exception as exc:  # noqa: BLE001 - the decode side then keeps its pages quarantined
        logger.warning("sglang-harden lifecycle: drain ack for room %s not sent: %r", room, exc)
