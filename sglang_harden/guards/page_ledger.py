"""The page ledger: who owns each KV page of one node's pool, in which state, since which reservation.

Invariant: every physical KV page has exactly one owner and one state at a time,
FREE -> RESERVED -> WRITING -> WRITTEN -> (FREE | QUARANTINED -> FREE); a page that was handed to a writer
and is let go before the writer drained goes to QUARANTINED, and leaves it only through
``confirm_drained(owner)``. Generations come from one counter per ledger, so a page's generation alone names
exactly one reservation (and with it the owner).

Each call returns who owns what afterwards (pages to free, to quarantine). Storage: three ``array`` columns by
page, O(pages touched) per call. The ``*_bulk`` operations (numpy, the hot path) first try the native library
(:mod:`sglang_harden.kernels.ledger_native`), which does only the usual case and otherwise writes nothing.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from sglang_harden.guards.base import Decision, Verdict, allow
from sglang_harden.kernels.ledger_native import DONE as _DONE
from sglang_harden.kernels.ledger_native import NOT_HANDLED as _NOT_HANDLED
from sglang_harden.kernels.ledger_native import LedgerOps, ledger_library
from sglang_harden.kernels.page_arrays import distinct
from sglang_harden.kernels.page_arrays import no_pages as _no_pages
from sglang_harden.kernels.page_arrays import numpy_module as _numpy

GUARD = "lifecycle"
NO_OWNER = -1
NONE_TRACKED = -2  # sole_owner: every page is FREE
MIXED = -3  # sole_owner: FREE and tracked pages, or several owners
RELEASED = 0  # release_unwritable: the pages were freed
NOT_HANDLED_HERE = -4  # release_unwritable_at: the native library did not take these pages; nothing changed


class PageState(IntEnum):
    FREE = 0
    RESERVED = 1
    WRITING = 2
    WRITTEN = 3
    QUARANTINED = 4


# plain ints for the numpy hot paths (an IntEnum member costs an attribute lookup and a conversion per use)
_FREE, _RESERVED, _WRITING, _WRITTEN, _QUARANTINED = (int(s) for s in PageState)


class LedgerError(RuntimeError):
    """A call that would break the ledger's invariant (e.g. reserving a page that is not free)."""


@dataclass(frozen=True)
class ReleaseOutcome:
    """What the caller must do with the released pages. ``ignored``: not this owner's, or already let go."""

    to_free: list[int]
    to_quarantine: list[int]
    ignored: list[int] = field(default_factory=list)


LedgerSnapshot = tuple[tuple[bytes, tuple[str | None, ...], tuple[int, ...]], int]


class PageLedger:
    """Owner, generation and state of each page of one node's KV pool."""

    def __init__(self, num_pages: int, native: bool = True) -> None:
        """``native=False``: the bulk operations stay on numpy even where the native library is available."""
        self.num_pages = num_pages
        self.native = native
        self._state = array("b", [PageState.FREE]) * num_pages
        self._owner = array("q", [NO_OWNER]) * num_pages
        self._generation = array("q", [0]) * num_pages
        self._next_generation = 1
        self._owner_ids: dict[str, int] = {}
        self._owner_names: dict[int, str] = {}
        self._reservations: dict[int, list[Any]] = {}  # owner id -> the page collections it reserved
        self._next_owner_id = 0
        self._quarantine: dict[int, list[int]] = {}
        self._quarantined = 0
        self._views: tuple[Any, Any, Any] | None = None
        self._native_ops: LedgerOps | None | bool = None  # None: not looked up yet; False: unavailable

    # ---- reading
    def state(self, page: int) -> PageState:
        return PageState(self._state[page])

    def owner(self, page: int) -> str | None:
        return self._owner_names.get(self._owner[page])

    def generation(self, page: int) -> int:
        return self._generation[page]

    def quarantined_count(self) -> int:
        return self._quarantined

    def state_column(self) -> array:
        """The page-state column itself (read it, never write it): lets a host scan many pages at once, e.g.
        ``numpy.frombuffer(ledger.state_column(), dtype=numpy.int8)``. Values are :class:`PageState`."""
        return self._state

    def holds_pages(self, owner: str) -> bool:
        """``owner`` still has pages in the ledger (reserved, written or quarantined)."""
        return owner in self._owner_ids

    def state_array(self) -> Any:
        """The page-state column as a numpy int8 view (read it, never write it)."""
        return self._np_columns()[0]

    def quarantined_owners(self) -> list[str]:
        """Owners that still have pages in quarantine."""
        return [self._owner_names[o] for o in self._quarantine]

    def quarantined_pages(self, owner: str) -> list[int]:
        owner_id = self._owner_ids.get(owner)
        return list(self._quarantine.get(owner_id, ())) if owner_id is not None else []

    # ---- decode side: reservation, writes, release
    def reserve(self, owner: str, pages: Sequence[int]) -> int:
        """Give ``pages`` (all FREE) to ``owner``; return the generation naming this reservation."""
        for page in pages:
            if self._state[page] != PageState.FREE:
                raise LedgerError(f"page {page} is {self.state(page).name} (owner {self.owner(page)}), not FREE")
        generation = self._next_generation
        self._next_generation += 1
        owner_id = self._intern(owner)
        for page in pages:
            self._state[page] = PageState.RESERVED
            self._owner[page] = owner_id
            self._generation[page] = generation
        self._reservations[owner_id].append(tuple(pages))
        return generation

    def begin_write(self, owner: str, pages: Iterable[int]) -> list[int]:
        """Pages are handed to a writer (their indices leave this node). Returns the pages refused (not owned
        by ``owner`` or not RESERVED/WRITING); a non-empty answer means the caller must abort the request."""
        return self._move(owner, pages, (PageState.RESERVED, PageState.WRITING), PageState.WRITING)

    def finish_write(self, owner: str, pages: Iterable[int]) -> list[int]:
        """Every write into ``pages`` landed. Returns the pages refused (see begin_write)."""
        return self._move(owner, pages, (PageState.WRITING, PageState.WRITTEN), PageState.WRITTEN)

    def release(self, owner: str, pages: Iterable[int], writer_drained: bool) -> ReleaseOutcome:
        """``owner`` lets go of ``pages``; pages a writer may still write are quarantined unless drained."""
        owner_id = self._owner_ids.get(owner, NO_OWNER)
        to_free: list[int] = []
        to_quarantine: list[int] = []
        ignored: list[int] = []
        for page in pages:
            state = self._state[page]
            if (
                owner_id == NO_OWNER
                or self._owner[page] != owner_id
                or state in (PageState.FREE, PageState.QUARANTINED)
            ):
                ignored.append(page)
            elif state == PageState.WRITING and not writer_drained:
                self._state[page] = PageState.QUARANTINED
                self._quarantine.setdefault(owner_id, []).append(page)
                self._quarantined += 1
                to_quarantine.append(page)
            else:
                self._free_page(page)
                to_free.append(page)
        if to_free:
            self._forget_if_empty(owner_id)
        return ReleaseOutcome(to_free, to_quarantine, ignored)

    def confirm_drained(self, owner: str) -> list[int]:
        """``owner``'s writer drained or is known gone: its quarantined pages go back to the free list."""
        owner_id = self._owner_ids.get(owner)
        if owner_id is None:
            return []
        pages = self._quarantine.pop(owner_id, [])
        self._quarantined -= len(pages)
        for page in pages:
            self._free_page(page)
        self._forget_if_empty(owner_id)
        return pages

    def admission_open(self, cap: int) -> Decision:
        """REJECT (503) new PD requests while ``cap`` or more pages are quarantined (cap <= 0: default)."""
        limit = cap if cap > 0 else default_quarantine_cap(self.num_pages)
        fields = {"quarantined_pages": self._quarantined, "cap": limit}
        if self._quarantined >= limit:
            reason = (
                f"{self._quarantined} KV pages are quarantined (cap {limit}) waiting for in-flight transfers "
                "to drain; not admitting new requests until they do"
            )
            return Decision(GUARD, Verdict.REJECT, reason, 503, fields)
        return allow(GUARD, **fields)

    # ---- bulk variants: the same rules over a numpy index array, for a host's hot path (numpy imported lazily).
    # Each costs a handful of numpy calls whatever the page count; duplicate pages are harmless everywhere.
    def reserve_bulk(self, owner: str, pages: Any, initial: PageState = PageState.RESERVED, *,
                     handed_over: bool = False) -> int:
        """:meth:`reserve` over an int64 numpy array of pages, in O(pages) vectorised work. ``initial=WRITING``
        reserves and hands the pages to the writer in one pass (reserve + :meth:`begin_write`). The ledger keeps
        a copy of ``pages``, or the array itself when ``handed_over`` (the caller made it and never changes it)."""
        if initial not in (PageState.RESERVED, PageState.WRITING):
            raise ValueError(f"a reservation starts RESERVED or WRITING, not {initial.name}")
        ops = self._native_ops if self._native_ops is not None else self._load_native()
        if ops:
            owner_id = self._owner_ids.get(owner, self._next_owner_id)  # the id _intern gives a new owner
            if ops.reserve(ops.state, ops.owner, ops.generation, self.num_pages, pages, int(initial), owner_id,
                           self._next_generation) == _DONE:
                return self._reserved(owner, pages if handed_over else pages.copy())
        np = _numpy()
        states, owners, generations = self._np_columns()
        if pages.size and np.count_nonzero(states[pages]):  # FREE is 0
            bad = int(pages[states[pages] != _FREE][0])
            raise LedgerError(f"page {bad} is {self.state(bad).name} (owner {self.owner(bad)}), not FREE")
        states[pages] = int(initial)
        owners[pages] = self._intern(owner)
        generations[pages] = self._next_generation
        return self._reserved(owner, pages if handed_over else pages.copy())

    def _reserved(self, owner: str, pages: Any) -> int:
        """Book a bulk reservation whose column entries are written: its generation, its owner's page list."""
        generation = self._next_generation
        self._next_generation += 1
        self._reservations[self._intern(owner)].append(pages)
        return generation

    def move_bulk(self, owner: str, pages: Any, target: PageState) -> Any:
        """:meth:`begin_write` (target WRITING) / :meth:`finish_write` (target WRITTEN) over a numpy array;
        returns the refused pages (a numpy array)."""
        owner_id = self._owner_ids.get(owner, NO_OWNER)
        if owner_id == NO_OWNER:
            return pages
        goal = int(target)
        before = _RESERVED if goal == _WRITING else _WRITING
        ops = self._native_ops if self._native_ops is not None else self._load_native()
        if ops and ops.move(ops.state, ops.owner, self.num_pages, pages, owner_id, before, goal) == _DONE:
            return _no_pages()
        np = _numpy()
        states, owners, _ = self._np_columns()
        st = states[pages]
        if not (np.count_nonzero(st != before) or np.count_nonzero(owners[pages] != owner_id)):
            states[pages] = goal  # the usual case: every page where the previous step left it
            return pages[:0]
        ok = owners[pages] == owner_id
        ok &= (st == before) | (st == goal)
        states[pages[ok]] = goal
        return pages[~ok]

    def release_bulk(self, owner: str, pages: Any, writer_drained: bool) -> ReleaseOutcome:
        """:meth:`release` over a numpy array of pages. The outcome's lists are numpy arrays here; a page listed
        twice in ``pages`` is quarantined once but may appear twice in ``to_free``."""
        owner_id = self._owner_ids.get(owner, NO_OWNER)
        if owner_id == NO_OWNER:
            return ReleaseOutcome(pages[:0], pages[:0], pages)  # type: ignore[arg-type]
        ops = self._native_ops if self._native_ops is not None else self._load_native()
        if ops and ops.release(ops.state, ops.owner, self.num_pages, pages, owner_id, writer_drained) == _DONE:
            if pages.size:
                self._forget_if_empty(owner_id)
            none = pages[:0]
            return ReleaseOutcome(pages, none, none)  # type: ignore[arg-type]
        np = _numpy()
        states, owners, _ = self._np_columns()
        st = states[pages]
        mine = owners[pages] == owner_id  # a FREE page has no owner, so "mine" already excludes FREE
        mine &= st != _QUARANTINED
        everything_mine = np.count_nonzero(mine) == mine.size
        if writer_drained or not np.count_nonzero(st == _WRITING):
            to_quarantine, to_free = pages[:0], pages if everything_mine else pages[mine]
        else:
            held = mine & (st == _WRITING)
            to_quarantine, to_free = distinct(pages[held]), pages[mine & ~held]
        if to_quarantine.size:
            states[to_quarantine] = _QUARANTINED
            self._quarantine.setdefault(owner_id, []).extend(to_quarantine.tolist())
            self._quarantined += int(to_quarantine.size)
        if to_free.size:
            states[to_free] = _FREE
            owners[to_free] = NO_OWNER
            self._forget_if_empty(owner_id)
        ignored = pages[:0] if everything_mine else pages[~mine]
        return ReleaseOutcome(to_free, to_quarantine, ignored)  # type: ignore[arg-type]

    def all_owned_written(self, owner: str, generation: int, pages: Any, page_size: int = 1) -> bool:
        """Page-tag fast path: every page owned by ``owner`` at ``generation`` and WRITTEN. A generation names
        one reservation, so pages that all carry ``generation`` have the owner of any one of them. ``page_size``
        > 1: ``pages`` holds token slots (int32 or int64), page = slot // page_size."""
        owner_id = self._owner_ids.get(owner)
        if owner_id is None:
            return False
        ops = self._native_ops if self._native_ops is not None else self._load_native()
        if ops:
            found = ops.owned_written(ops.state, ops.owner, ops.generation, self.num_pages, pages, page_size,
                                      owner_id, generation)
            if found != _NOT_HANDLED:
                return found == _DONE
        np = _numpy()
        states, owners, generations = self._np_columns()
        if page_size > 1:
            pages = pages // page_size
        if not pages.size or owners[pages[0]] != owner_id:
            return owner_id is not None and not pages.size
        return not (np.count_nonzero(generations[pages] != generation) or np.count_nonzero(states[pages] != _WRITTEN))

    def row_owned_written(self, owner: str, generation: int, table: Any, row: int, length: int,
                          page_size: int = 1) -> bool:
        """:meth:`all_owned_written` over ``table[row, :length]`` of a 2-D int numpy array (a host's page table),
        read in place."""
        owner_id = self._owner_ids.get(owner)
        if owner_id is None:
            return False
        ops = self._native_ops if self._native_ops is not None else self._load_native()
        if ops:
            found = ops.row_owned_written(ops.state, ops.owner, ops.generation, self.num_pages, table, row, length,
                                          page_size, owner_id, generation)
            if found != _NOT_HANDLED:
                return found == _DONE
        return self.all_owned_written(owner, generation, table[row, :length], page_size)

    def sole_owner(self, pages: Any) -> int:
        """The owner id of ``pages`` when none is FREE and one owner holds them all; :data:`NONE_TRACKED` when
        every page is FREE; :data:`MIXED` otherwise (a free path's question: whose pages are these?)."""
        ops = self._native_ops if self._native_ops is not None else self._load_native()
        if ops:
            found = ops.sole_owner(ops.state, ops.owner, self.num_pages, pages)
            if found != NOT_HANDLED_HERE:
                return int(found)
        np = _numpy()
        states, owners, _ = self._np_columns()
        tracked = np.count_nonzero(states[pages])  # FREE is 0
        if tracked == 0:
            return NONE_TRACKED
        if tracked != pages.size:
            return MIXED
        owner_ids = owners[pages]
        first = owner_ids[0]
        return int(first) if np.count_nonzero(owner_ids != first) == 0 else MIXED

    def owner_groups(self, pages: Any) -> list[tuple[str, Any]]:
        """``pages`` (numpy) split by owner, FREE pages left out: ``[(owner, its pages)]`` (a free path's question
        when it must release each owner's pages by that owner's rule)."""
        sole = self.sole_owner(pages)
        if sole == NONE_TRACKED:
            return []
        if sole != MIXED:
            groups = [(sole, pages)]
        else:
            tracked = pages[self.state_array()[pages] != PageState.FREE]
            owner_ids = self.owner_ids_of(tracked)
            groups = [(o, tracked[owner_ids == o]) for o in distinct(owner_ids).tolist()]
        named = ((self.owner_name(owner_id), owned) for owner_id, owned in groups)
        return [(owner, owned) for owner, owned in named if owner is not None]

    def release_unwritable(self, pages: Any) -> tuple[int, str | None]:
        """A free path's usual case in one step: the tracked pages of ``pages`` (FREE ones, such as the slots of
        tokens decode generated itself, are left as they are) all belong to one owner and none is WRITING (so no
        writer can still write them; whether it drained does not matter) or QUARANTINED: release them, as
        :meth:`release_bulk` would, and return ``(RELEASED, owner)``. Otherwise change nothing and return
        ``(NONE_TRACKED, None)`` (every page FREE) or ``(MIXED, None)`` (anything else: use release_bulk)."""
        ops = self._native_ops if self._native_ops is not None else self._load_native()
        if ops:
            found = ops.release_unwritable(ops.state, ops.owner, self.num_pages, pages)
            if found >= 0:
                return self._released_by_native(found)
            if found != NOT_HANDLED_HERE:
                return found, None
        np = _numpy()
        states = self._np_columns()[0]
        tracked = pages[states[pages] != _FREE]
        if not tracked.size:
            return NONE_TRACKED, None
        sole = self.sole_owner(tracked)
        tracked_states = states[tracked]
        if sole < 0 or np.count_nonzero(tracked_states == _WRITING) or np.count_nonzero(tracked_states == _QUARANTINED):
            return MIXED, None
        owner = self._owner_names[sole]
        self.release_bulk(owner, tracked, writer_drained=False)
        return RELEASED, owner

    def release_unwritable_at(self, address: int, count: int, wide: bool) -> tuple[int, str | None]:
        """:meth:`release_unwritable` over ``count`` page numbers (int64 if ``wide``, else int32) at a host address
        (a CPU tensor's memory, read in place). Native only: without the library, or for pages it does not
        handle, nothing changes and the answer is ``(NOT_HANDLED_HERE, None)``."""
        ops = self._native_ops if self._native_ops is not None else self._load_native()
        if not ops:
            return NOT_HANDLED_HERE, None
        found = ops.release_unwritable_at(ops.state, ops.owner, self.num_pages, address, count, int(wide))
        if found >= 0:
            return self._released_by_native(found)
        return (found, None) if found in (NONE_TRACKED, MIXED) else (NOT_HANDLED_HERE, None)

    def _released_by_native(self, owner_id: int) -> tuple[int, str | None]:
        """Bookkeeping after the native library released ``owner_id``'s pages; the release's answer."""
        owner = self._owner_names[owner_id]
        self._forget_if_empty(owner_id)
        return RELEASED, owner

    def owner_ids_of(self, pages: Any) -> Any:
        """Owner ids (numpy) of ``pages``; :meth:`owner_name` turns one into the owner's name."""
        return self._np_columns()[1][pages]

    def owner_name(self, owner_id: int) -> str | None:
        return self._owner_names.get(int(owner_id))

    def _np_columns(self) -> tuple[Any, Any, Any]:
        """numpy views of the three columns (made once: the columns are never resized, only replaced by
        :meth:`restore`, which builds a new ledger)."""
        if self._views is None:
            import numpy as np

            self._views = (np.frombuffer(self._state, dtype=np.int8), np.frombuffer(self._owner, dtype=np.int64),
                           np.frombuffer(self._generation, dtype=np.int64))
        return self._views

    def _load_native(self) -> LedgerOps | bool:
        """The native library bound to this ledger's columns (looked up once; False: numpy only)."""
        lib = ledger_library() if self.native else None
        self._native_ops = LedgerOps(lib, self._state, self._owner, self._generation) if lib is not None else False
        return self._native_ops

    # ---- snapshots (for the protocol model's explorer)
    def snapshot(self) -> LedgerSnapshot:
        """Everything the ledger knows, as a hashable value (columns: states, owners, generations)."""
        names = self._owner_names
        owners = tuple(names.get(o) for o in self._owner) if names else (None,) * self.num_pages
        return (self._state.tobytes(), owners, tuple(self._generation)), self._next_generation

    @classmethod
    def restore(cls, snap: LedgerSnapshot) -> PageLedger:
        (states, owners, generations), next_generation = snap
        ledger = cls(len(owners))
        ledger._state = array("b", states)
        ledger._generation = array("q", generations)
        ledger._views = None
        ledger._native_ops = None
        for page, owner in enumerate(owners):
            if owner is None:
                continue
            owner_id = ledger._intern(owner)
            ledger._owner[page] = owner_id
            ledger._reservations[owner_id].append((page,))
            if states[page] == PageState.QUARANTINED:
                ledger._quarantine.setdefault(owner_id, []).append(page)
                ledger._quarantined += 1
        ledger._next_generation = next_generation
        return ledger

    # ---- internals
    def _intern(self, owner: str) -> int:
        owner_id = self._owner_ids.get(owner)
        if owner_id is None:
            owner_id = self._next_owner_id
            self._next_owner_id += 1
            self._owner_ids[owner] = owner_id
            self._owner_names[owner_id] = owner
            self._reservations[owner_id] = []
        return owner_id

    def _move(self, owner: str, pages: Iterable[int], allowed: tuple[int, ...], target: PageState) -> list[int]:
        owner_id = self._owner_ids.get(owner, NO_OWNER)
        refused = []
        for page in pages:
            if owner_id == NO_OWNER or self._owner[page] != owner_id or self._state[page] not in allowed:
                refused.append(page)
            else:
                self._state[page] = target
        return refused

    def _free_page(self, page: int) -> None:
        self._state[page] = PageState.FREE
        self._owner[page] = NO_OWNER

    def _forget_if_empty(self, owner_id: int) -> None:
        """Drop ``owner_id`` once it holds no page at all (none owned, none quarantined)."""
        if owner_id in self._quarantine:
            return
        if any(self._still_owns(owner_id, pages) for pages in self._reservations[owner_id]):
            return
        del self._reservations[owner_id]
        del self._owner_ids[self._owner_names.pop(owner_id)]

    def _still_owns(self, owner_id: int, pages: Any) -> bool:
        if isinstance(pages, tuple):
            return any(self._owner[page] == owner_id for page in pages)
        ops = self._native_ops if self._native_ops is not None else self._load_native()
        if ops:
            count = ops.count_owned(ops.owner, self.num_pages, pages, owner_id)
            if count >= 0:
                return count > 0
        return bool(_numpy().count_nonzero(self._np_columns()[1][pages] == owner_id))


def default_quarantine_cap(num_pages: int) -> int:
    """A quarter of the pool: enough to ride out a few stuck transfers, small enough to keep serving."""
    return max(1, num_pages // 4)
