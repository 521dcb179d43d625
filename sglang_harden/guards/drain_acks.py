"""Drain acknowledgements that count: which of prefill's acks may end the quarantine of a transfer's pages.

Invariant: an ack counts toward a transfer's drain only when decode recorded a live transfer of the ack's room,
that transfer's abort notice was armed before the ack arrived, the ack carries the generation the notice was
armed with (releases that number their notices; elsewhere the transfer itself is the generation: its acks start
empty), and it names a prefill rank the transfer targets that has not acked yet. The transfer drained once every
targeted rank acked. Any other ack is counted and ignored. The table holds an entry per live transfer only
(dropped with it) and at most ``cap``: past it the oldest entry goes, and that transfer's pages then wait for
their sender to be known gone (fail closed).

Shared by the plugin (``compat/lifecycle_nodes.py``) and the backport series (bundled into ``pd_lifecycle``). What
the transfer targets and which generation its notice carries are read from SGLang by ``compat/drain_ack.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from sglang_harden.guards.base import Decision, Verdict, allow
from sglang_harden.guards.page_ledger import GUARD

MAX_ROOMS = 1 << 16  # acks of at most this many live transfers are tracked (a transfer holds >= 1 page)

# why an ack was not counted (the ``why`` field of the decision; the backport series counts by it)
NO_TRANSFER = "no_live_transfer"
NOT_ARMED = "notice_not_armed"
STALE = "stale_generation"
NOT_TARGETED = "rank_not_targeted"
DUPLICATE = "duplicate_rank"
UNKNOWN_RANKS = "targets_unknown"
EVICTED = "table_full"


def _no_generation() -> int | None:
    return None


@dataclass
class _Entry:
    expected: frozenset[int]
    generation: Callable[[], int | None]  # the generation the transfer's abort notice carries now (None: none)
    armed: bool = False
    acked: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class AckCount:
    """A transfer's drain evidence from acks: how many prefill ranks must ack, how many did."""

    required: int
    acked: int


def _rejected(why: str, reason: str, room: int, rank: int | None = None, generation: int | None = None,
              verdict: Verdict = Verdict.REJECT) -> Decision:
    return Decision(GUARD, verdict, f"drain ack ignored: {reason}", None,
                    {"why": why, "room": room, "rank": rank, "ack_generation": generation})


class AckBook:
    """The drain acks of the live transfers of one decode node, by room. Transfers open and close their entry on
    the scheduler thread; acks arrive on receiver threads; one lock orders them."""

    def __init__(self, cap: int = MAX_ROOMS) -> None:
        self.cap = max(1, int(cap))
        self._rooms: dict[int, _Entry] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._rooms)

    def open(self, room: int, expected: Iterable[int] | None, armed: bool = False,
             generation: Callable[[], int | None] = _no_generation) -> Decision:
        """A transfer of ``room`` began: acks of an earlier use of the room no longer count. ``expected``: the
        prefill ranks it targets, as each names itself in its ack (None: unknown, so no ack can count); ``armed``:
        its abort notice already went out; ``generation``: reads the generation that notice carries."""
        ranks = frozenset(int(rank) for rank in expected) if expected is not None else frozenset()
        evicted: int | None = None
        with self._lock:
            self._rooms.pop(int(room), None)
            if len(self._rooms) >= self.cap:
                evicted = next(iter(self._rooms))
                del self._rooms[evicted]
            self._rooms[int(room)] = _Entry(ranks, generation, armed)
        if evicted is not None:
            return _rejected(EVICTED, f"more than {self.cap} live transfers; the acks of room {evicted} are no "
                             "longer tracked (its pages wait for the sender to be gone)", evicted)
        if not ranks:
            return _rejected(UNKNOWN_RANKS, "cannot tell which prefill ranks this transfer targets: no ack will "
                             "count (its pages wait for the sender to be gone)", int(room))
        return allow(GUARD, room=int(room), expected_ranks=sorted(ranks))

    def arm(self, room: int) -> None:
        """The abort notice of ``room``'s transfer is about to go out: acks may follow from now on."""
        with self._lock:
            entry = self._rooms.get(int(room))
            if entry is not None:
                entry.armed = True

    def close(self, room: int) -> None:
        """The transfer of ``room`` is over (its pages are back): its acks go with it."""
        with self._lock:
            self._rooms.pop(int(room), None)

    def note(self, room: int, rank: int, generation: int | None = None) -> Decision:
        """Prefill rank ``rank`` acknowledged that its writes of ``room`` drained (``generation``: the one its ack
        names, None on releases without). ALLOW: counted; otherwise why it was ignored."""
        room, rank = int(room), int(rank)
        with self._lock:
            entry = self._rooms.get(room)
            if entry is None:
                return _rejected(NO_TRANSFER, f"room {room} has no live transfer here", room, rank, generation)
            if not entry.armed:
                return _rejected(NOT_ARMED, f"the abort notice of room {room} was not sent yet", room, rank,
                                 generation)
            current = entry.generation()
            if (generation is not None or current is not None) and generation != current:
                return _rejected(STALE, f"generation {generation} is not the one room {room}'s notice carries "
                                 f"({current})", room, rank, generation)
            if not entry.expected:
                return _rejected(UNKNOWN_RANKS, f"which prefill ranks the transfer of room {room} targets is "
                                 "unknown", room, rank, generation)
            if rank not in entry.expected:
                return _rejected(NOT_TARGETED, f"prefill rank {rank} is not one the transfer of room {room} "
                                 f"targets {sorted(entry.expected)}", room, rank, generation)
            if rank in entry.acked:
                return _rejected(DUPLICATE, f"prefill rank {rank} already acknowledged room {room}", room, rank,
                                 generation, verdict=Verdict.SKIP)
            entry.acked.add(rank)
        return allow(GUARD, room=room, rank=rank)

    def count(self, room: int) -> AckCount:
        with self._lock:
            entry = self._rooms.get(int(room))
            if entry is None:
                return AckCount(0, 0)
            return AckCount(len(entry.expected), len(entry.acked))
