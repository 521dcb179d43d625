"""Prefill's side of the page lifecycle on one SGLang 0.5.x scheduler process: a :class:`SourceRoom` record per
bootstrap room whose transfer has not settled (its source pages, the pages SGLang freed that we keep back, a failed
write, the drain acks withheld and the ack targets SGLang dropped) and the :class:`PrefillNode` that keeps them. The
hooks that feed it are in :mod:`.lifecycle_v05` and :mod:`.backends`; the rule comes from
:func:`sglang_harden.guards.lifecycle.source_settled`.
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
from sglang_harden.compat.lifecycle_nodes import HeldFree, _kv_poll
from sglang_harden.config import Mode
from sglang_harden.guards import lifecycle
from sglang_harden.guards.base import Decision, Verdict

logger = logging.getLogger("sglang_harden")


class UnreadChunk:
    """A chunk's page indices in pinned host memory, valid once SGLang's copy event completed."""

    def __init__(self, indices: Any, event: Any) -> None:
        self.indices, self.event = indices, event


@dataclass
class SourceRoom:
    """What this prefill knows of one room's transfer, until it settled. Written by three kinds of thread: the
    scheduler (``sources``, ``pending``), transfer workers (``failed_at``, ``stashed_acks``) and the bootstrap
    thread (``stashed_acks``, ``kept_target``); :class:`PrefillNode` creates, changes and drops records under one
    lock, so a mark made while the scheduler drops the record as settled lands in a new record, never a lost one."""

    sources: list[np.ndarray] = field(default_factory=list)  # each chunk's source pages (int64, the node's copy)
    pending: list[int] = field(default_factory=list)  # pages SGLang freed that are kept back until the room settles
    failed_at: float | None = None  # the transport gave up on a write of the room then (it may still land)
    stashed_acks: list[Callable[[], Any]] = field(default_factory=list)  # drain acks withheld until settled
    kept_target: Any = None  # a drain-ack target SGLang dropped (sent to once the room settled)
    distinct: tuple[int, np.ndarray] | None = None  # (len(sources), their distinct pages): asked on every step
    # chunks whose page indices are still being copied to the host (0.5.21+): (the pinned tensor, its event)
    unread_sources: list[UnreadChunk] = field(default_factory=list)
    held: list[HeldFree] = field(default_factory=list)  # frees of the room's request kept back until it settles

    def needs_attention(self) -> bool:
        """Something the scheduler's settle step must still do for this room."""
        return bool(self.pending or self.held or self.stashed_acks or self.kept_target is not None
                    or self.failed_at is not None)

    def empty(self) -> bool:
        return not self.sources and not self.unread_sources and not self.needs_attention()


@dataclass
class PrefillNode:
    """Source pages of transfers that have not settled yet. Its ledger is one column, ``held_room`` (page -> the
    room whose transfer reads it, 0: none), plus a :class:`SourceRoom` per room. ``attention`` names the rooms whose
    record has something for the settle step, so a scheduler step with none costs one set test."""

    allocator: Any
    page_size: int
    num_pages: int
    held_room: np.ndarray
    kv_mgr: Any = None
    rooms: dict[int, SourceRoom] = field(default_factory=dict)
    attention: set[int] = field(default_factory=set)
    lifetime_s: float = 30.0
    given_back: list[HeldFree] = field(default_factory=list)  # kept-back frees of rooms that settled, to free
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def for_allocator(cls, allocator: Any) -> PrefillNode:
        page_size = int(getattr(allocator, "page_size", 1) or 1)
        num_pages = int(allocator.size) // page_size + 2
        return cls(allocator, page_size, num_pages, np.zeros(num_pages, dtype=np.int64))

    # ------------------------------------------------------------ records (any thread)

    def _change(self, room: int, change: Callable[[SourceRoom], None]) -> None:
        with self._lock:
            record = self.rooms.setdefault(room, SourceRoom())
            change(record)
            if record.needs_attention():
                self.attention.add(room)

    def _take(self, room: int, take: Callable[[SourceRoom], Any]) -> Any:
        """``take(record)`` under the lock (None without a record); the record goes once nothing is left in it."""
        with self._lock:
            record = self.rooms.get(room)
            if record is None:
                return None
            taken = take(record)
            if not record.needs_attention():
                self.attention.discard(room)
            if record.empty():
                del self.rooms[room]
            return taken

    def hold(self, kv_mgr: Any, room: int, pages: np.ndarray) -> None:
        """Hold ``pages`` (an int64 array that becomes the node's) until ``room``'s transfer settles."""
        self.kv_mgr = kv_mgr
        self._change(room, lambda record: record.sources.append(pages))
        self.held_room[pages] = room

    def hold_unread(self, kv_mgr: Any, room: int, indices: Any, event: Any) -> Callable[[], None]:
        """Hold the pages of a chunk whose indices SGLang is still copying to the host (``indices``, pinned,
        complete once ``event`` is): they are read once the event says so, by whoever asks first -- the transfer
        worker, which waits on the event before it reads the indices itself, or this node. Returns what reads
        them (idempotent)."""
        self.kv_mgr = kv_mgr
        chunk = UnreadChunk(indices, event)
        self._change(room, lambda record: record.unread_sources.append(chunk))
        return lambda: self._read_chunk(room, chunk)

    def _read_chunk(self, room: int, chunk: UnreadChunk) -> None:
        def take(record: SourceRoom) -> bool:
            for i, unread in enumerate(record.unread_sources):
                if unread is chunk:
                    del record.unread_sources[i]
                    return True
            return False

        if self._take(room, take):
            self.hold(self.kv_mgr, room, np.array(chunk.indices.numpy(), dtype=np.int64))

    def read_landed_sources(self, wait: bool = False) -> None:
        """Hold the chunks whose index copies landed (``wait``: all of them, a host synchronisation: only the
        rare paths that must know every source page call it so)."""
        with self._lock:
            unread = [(room, chunk) for room, record in self.rooms.items() for chunk in record.unread_sources]
        for room, chunk in unread:
            if wait:
                chunk.event.synchronize()
            elif not chunk.event.query():
                continue
            self._read_chunk(room, chunk)

    def free_of_room_is_safe(self, room: int) -> bool:
        """Whether SGLang may free the pages of ``room``'s request now: no chunk of it may still be read."""
        record = self.rooms.get(room)
        if record is None or (not record.sources and not record.unread_sources and record.failed_at is None):
            return True
        if self.settled(room):
            self._settle(room)
            return True
        return False

    def hold_free(self, room: int, held: HeldFree, mode: Mode) -> bool:
        """Keep a free of ``room``'s request back until the room settled (False: log mode, free it now)."""
        decision = Decision(lifecycle.GUARD, Verdict.QUARANTINE,
                            f"pages of room {room} freed before its transfer settled; held", None,
                            {"room": room, "tokens": held.tokens})
        if not events.record(decision, mode):
            return False
        self._change(room, lambda record: record.held.append(held))
        return True

    def note_failed_write(self, rooms: Sequence[int]) -> None:
        """The transport gave up on a write of these rooms: its bytes may still land for ``lifetime_s``."""
        now = time.monotonic()
        for room in rooms:
            self._change(int(room), lambda record: setattr(record, "failed_at", now))

    def stash_ack(self, room: int, send: Callable[[], Any]) -> None:
        self._change(room, lambda record: record.stashed_acks.append(send))

    def keep_ack_target(self, room: int, target: Any) -> None:
        """Keep a drain-ack target SGLang drops (a ``(decode_ip, decode_port)`` tuple, or 0.5.21+'s
        ``{(ip, port): AckTarget}``, copied and merged with the ones already kept)."""

        def keep(record: SourceRoom) -> None:
            if isinstance(target, dict):
                kept = record.kept_target if isinstance(record.kept_target, dict) else {}
                record.kept_target = {**kept, **target}
            else:
                record.kept_target = target

        self._change(room, keep)

    # ------------------------------------------------------------ what the node knows of a room

    def write_failed(self, room: int) -> bool:
        record = self.rooms.get(room)
        return record is not None and record.failed_at is not None

    def failed_without_write_in_flight(self, room: int) -> bool:
        """Called by the transfer worker that fails ``room``: no write of the room can still land. Mooncake's
        writes are synchronous on the worker that fails the room (it dequeued the room's only chunk in flight),
        so only a write the transport gave up on (:meth:`note_failed_write`) may still land."""
        return not self.write_failed(room)

    def chunks_queued(self, room: int) -> bool:
        """Whether a chunk of ``room`` was handed to the transfer engine (and its sources not let go since)."""
        record = self.rooms.get(room)
        return record is not None and bool(record.sources or record.pending or record.failed_at is not None)

    def write_may_land(self, room: int) -> bool:
        """A failed write of ``room`` may still land (within its lifetime; lifetime 0: until the sender is gone)."""
        record = self.rooms.get(room)
        failed_at = None if record is None else record.failed_at
        return failed_at is not None and (self.lifetime_s <= 0 or time.monotonic() - failed_at < self.lifetime_s)

    def settled(self, room: int) -> bool:
        """The guard's rule (``lifecycle.source_settled``) on what this process knows of the room's transfer."""
        record = self.rooms.get(room)
        failed_at = None if record is None else record.failed_at
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
            self._forget_failure(room, failed_at)  # its lifetime is over
        return True

    def _forget_failure(self, room: int, failed_at: float) -> None:
        def forget(record: SourceRoom) -> None:
            if record.failed_at == failed_at:  # not a newer failure marked meanwhile
                record.failed_at = None

        self._take(room, forget)

    # ------------------------------------------------------------ the allocator's free path (scheduler)

    def keep_back(self, pages: np.ndarray, mode: Mode) -> np.ndarray | None:
        """Mask of ``pages`` whose transfer has not settled (None: free them all); settled rooms let go."""
        self.read_landed_sources(wait=True)
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
                kept = pages[mine].tolist()
                self._change(room, lambda record, kept=kept: record.pending.extend(kept))
        return keep if keep.any() else None

    def _settle(self, room: int) -> None:
        """Let go of the room's sources (the pages kept back for it are freed by :meth:`settle_pending`)."""

        def settle(record: SourceRoom) -> list[np.ndarray]:
            sources = record.sources
            record.sources, record.distinct, record.unread_sources = [], None, []
            return sources

        for pages in self._take(room, settle) or ():
            self.held_room[pages[self.held_room[pages] == room]] = 0

    def settle_pending(self) -> list[int]:
        """The scheduler's step: the pages kept back for rooms that settled (to free), and the acks they waited for."""
        freed: list[int] = []
        for room in self._attention_now():
            record = self.rooms.get(room)
            failed_at = None if record is None else record.failed_at
            if failed_at is not None and not self.write_may_land(room):
                self._forget_failure(room, failed_at)
            if not self.settled(room):
                continue
            pending, held = self._take(room, _take_pending) or ([], [])
            if pending or held:
                freed.extend(pending)
                self.given_back.extend(held)
                self._settle(room)
            self._send_kept_acks(room)
        return freed

    def take_given_back(self) -> list[HeldFree]:
        """The kept-back frees of rooms that settled (the caller frees them)."""
        given, self.given_back = self.given_back, []
        return given

    def _attention_now(self) -> list[int]:
        with self._lock:
            return sorted(self.attention)

    def _send_kept_acks(self, room: int) -> None:
        def take(record: SourceRoom) -> tuple[Any, list[Callable[[], Any]]]:
            target, acks = record.kept_target, record.stashed_acks
            record.kept_target, record.stashed_acks = None, []
            return target, acks

        target, acks = self._take(room, take) or (None, [])
        if target is not None:
            _send_orphan_ack(self.kv_mgr, room, target)
            events.record(Decision(lifecycle.GUARD, Verdict.RELEASE, "drain ack SGLang dropped, sent once the room "
                                   "settled", None, {"room": room}), Mode.ENFORCE)
        if acks:
            for send in acks:
                send()
            events.record(Decision(lifecycle.GUARD, Verdict.RELEASE, "drain ack sent after the write settled",
                                   None, {"room": room}), Mode.ENFORCE)

    def busy(self) -> bool:
        return bool(self.attention)

    def unsettled(self) -> bool:
        """Whether any room's transfer still reads source pages or needs the settle step."""
        return bool(self.attention) or bool(self.rooms)

    # ------------------------------------------------------------ admission budget and reports

    def stuck_tokens(self) -> int:
        """Tokens of source pages that a transfer still pins after SGLang let go of them, not yet through the free
        path: they sit in the prefix cache, where SGLang counts them as evictable, but evicting them frees nothing.
        The allocator reports them as not available, so admission stops promising them. Two kinds of room pin
        them: one whose write failed (its bytes may land for the write lifetime), and one SGLang failed (an abort)
        while the transfer worker still reads a chunk of it."""
        stuck = 0
        for room in self._rooms_pinning_released_pages():
            record = self.rooms.get(room)
            if record is None or not record.sources:
                continue
            held = int(np.count_nonzero(self.held_room[self._distinct_sources(record)] == room))
            kept_back = len(record.pending) + sum(h.tokens for h in record.held) // self.page_size
            stuck += max(0, held - kept_back)
        return stuck * self.page_size

    def _rooms_pinning_released_pages(self) -> set[int]:
        rooms = {room for room in self._attention_now() if self.write_may_land(room)}
        rooms.update(self._failed_rooms_still_read())
        return rooms

    def _failed_rooms_still_read(self) -> list[int]:
        """Rooms SGLang failed (and so released) while a chunk of theirs is still queued or in flight."""
        mgr = self.kv_mgr
        outstanding = getattr(mgr, "_staging_outstanding", None)
        if not outstanding:
            return []
        failed = _kv_poll().failed
        return [room for room, chunks in list(outstanding.items())
                if chunks > 0 and mgr.request_status.get(room) == failed]

    def released_pages_pinned(self) -> bool:
        """Whether some room SGLang already let go of still pins source pages (then a page the tree cache evicts
        may be one a transfer still reads)."""
        return self.pins_released_pages() and bool(self._rooms_pinning_released_pages())

    def pins_released_pages(self) -> bool:
        """Cheap test before :meth:`stuck_tokens` (asked on every admission check)."""
        return bool(self.attention) or bool(getattr(self.kv_mgr, "_staging_outstanding", None))

    def _distinct_sources(self, record: SourceRoom) -> np.ndarray:
        """The room's source pages, each once (cached: a room's sources only grow until it settles)."""
        sources = record.sources
        cached = record.distinct
        if cached is None or cached[0] != len(sources):
            cached = (len(sources), lifecycle.distinct(np.concatenate(sources)))
            record.distinct = cached
        return cached[1]

    def held_tokens(self) -> int:
        """Tokens kept back from the free list plus those :meth:`stuck_tokens` hides from the allocator's count."""
        records = [self.rooms.get(room) for room in self._attention_now()]
        pending = sum(len(record.pending) for record in records if record is not None)
        held = sum(h.tokens for record in records if record is not None for h in record.held)
        given = sum(h.tokens for h in self.given_back)
        return pending * self.page_size + held + given + self.stuck_tokens()

    def view(self, part: str) -> dict[int, Any]:
        """``{room: that part of its record}`` for the rooms where it is set (reports and tests)."""
        with self._lock:
            records = list(self.rooms.items())
        return {room: getattr(record, part) for room, record in records if getattr(record, part) not in (None, [])}

    def report(self) -> dict[str, Any]:
        pending, acks = self.view("pending"), self.view("stashed_acks")
        return {
            "role": "prefill",
            "page_size": self.page_size,
            "source_pages_held_back": sum(len(p) for p in pending.values()),
            "rooms_unsettled": len(pending),
            "drain_acks_withheld": sum(len(a) for a in acks.values()),
            "ack_targets_kept_past_clear": len(self.view("kept_target")),
            "rooms_with_failed_writes": len(self.view("failed_at")),
            "frees_kept_back": sum(len(h) for h in self.view("held").values()),
            "chunks_with_unread_indices": sum(len(u) for u in self.view("unread_sources").values()),
            "cached_tokens_pinned_by_failed_writes": self.stuck_tokens(),
        }


def _take_pending(record: SourceRoom) -> tuple[list[int], list[HeldFree]]:
    pending, held = record.pending, record.held
    record.pending, record.held = [], []
    return pending, held


def _send_orphan_ack(mgr: Any, room: int, target: Any) -> None:
    """The drain ack whose target SGLang dropped while the room was still being written."""
    try:
        if isinstance(target, tuple):  # 0.5.19/0.5.20: (decode_ip, decode_port)
            mgr._send_abort_ack(target[0], target[1], room)
        else:  # 0.5.21+: {(ip, port): AckTarget}
            mgr._send_abort_acks(room, target)
    except Exception as exc:  # noqa: BLE001 - the decode side then keeps its pages quarantined
        logger.warning("sglang-harden lifecycle: drain ack for room %s not sent: %r", room, exc)
