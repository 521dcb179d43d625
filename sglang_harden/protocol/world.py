"""The state of the modelled PD pair: plain ints and tuples, frozen into one hashable tuple per state.

One *page* stands for one token's KV (the model's unit of length). Page contents are tagged with the request
that wrote them (``rid + 1``; 0 = never written): pages are reused without zeroing, so a read of a page that
this request's own transfer did not write is observable as a foreign (another request's KV) or unwritten read.
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass, field

# prefill phases
P_NEW, P_QUEUED, P_READY, P_FORWARDED, P_SENDING, P_DONE, P_ENDED = range(7)
# decode phases
D_NEW, D_QUEUED, D_WAITING, D_RUNNING, D_DONE, D_ENDED = range(6)
# transfer status, as both sides see it through the KV manager
T_NONE, T_SENDING, T_SUCCESS, T_FAILED = range(4)
# pending-rejection bits: which node's validate_input_length stubbed the request
PENDING_PREFILL, PENDING_DECODE = 1, 2
# client-side events already used, one bit each
CLIENT_ABORTED, PREFILL_DISCONNECTED = 1, 2

PREFILL_PHASES = ("new", "queued", "bootstrapped", "forwarded", "sending", "done", "ended")
DECODE_PHASES = ("new", "queued", "waiting", "running", "done", "ended")
PER_REQUEST = (
    "p_phase", "d_phase", "p_len", "d_len", "pending", "p_abort", "handshook", "dst", "gen", "src", "ops",
    "issued", "status", "meta", "notice", "error", "completed", "client", "quar", "held", "expired", "ack_lost",
    "gone",
)  # fmt: skip
GLOBAL = ("p_free", "d_free", "d_quar", "p_content", "d_content", "d_ledger", "faulted")
ENDED_P = (P_DONE, P_ENDED)
ENDED_D = (D_DONE, D_ENDED)


@dataclass(frozen=True)
class RequestSpec:
    """One scripted request: its prompt length in pages, and whether prefill runs with --allow-auto-truncate."""

    prompt_len: int
    auto_truncate: bool = False

    def label(self) -> str:
        return f"{self.prompt_len}{'t' if self.auto_truncate else ''}"


@dataclass(frozen=True)
class ModelConfig:
    requests: tuple[RequestSpec, ...]
    prefill_pages: int
    decode_pages: int
    prefill_limit: int
    decode_limit: int
    context_len: int
    transfer_window: int = 2
    quarantine_cap: int = 0
    capacity_mode: str = "log"
    client_events: bool = True
    timeouts: bool = True
    events_off: frozenset[str] = field(default_factory=frozenset)
    faults: frozenset[str] = field(default_factory=frozenset)
    # a write the transport gave up on outlives the sender's write lifetime (the residual risk of that setting)
    write_lifetime: bool = False
    # prefill's drain ack can be lost; decode then learns only that the sender is gone
    lost_acks: bool = False

    @property
    def n(self) -> int:
        return len(self.requests)


def room_of(r: int) -> int:
    """The bootstrap room the router picked for request ``r`` (a large odd number, like a random u63)."""
    return 0x5EED_0000_0000 + 2 * r + 1


def rid_of(r: int) -> str:
    return f"r{r}"


def mask_of(pages: tuple[int, ...] | list[int]) -> int:
    mask = 0
    for page in pages:
        mask |= 1 << page
    return mask


def lowest_free(mask: int, count: int) -> tuple[int, ...]:
    """The ``count`` lowest-numbered free pages (allocators reuse freed pages; nothing is zeroed)."""
    pages: list[int] = []
    page = 0
    while len(pages) < count:
        if mask >> page & 1:
            pages.append(page)
        page += 1
    return tuple(pages)


_COLUMN = {name: i for i, name in enumerate(PER_REQUEST)}
Columns = namedtuple("Columns", PER_REQUEST)  # read-only view of a frozen state's per-request columns
Globals = namedtuple("Globals", GLOBAL)


class World:
    """A mutable view of one state for the duration of one transition; ``freeze()`` makes it hashable.

    States are stored column-wise (one tuple per field, indexed by request). A column becomes a list only
    when a transition first touches it, and ``freeze`` reuses every untouched column as it is: most events
    touch a handful of the twenty columns, so thawing and freezing cost little.
    """

    __slots__ = PER_REQUEST + GLOBAL + ("_rows", "_touched", "_ledger_cache")

    @classmethod
    def initial(cls, config: ModelConfig) -> World:
        n = config.n
        rows = tuple(tuple(() if name in ("dst", "src", "ops") else 0 for _ in range(n)) for name in PER_REQUEST)
        globals_ = (
            (1 << config.prefill_pages) - 1, (1 << config.decode_pages) - 1, 0,
            (0,) * config.prefill_pages, (0,) * config.decode_pages, None, 0,
        )  # fmt: skip
        return cls.thaw((rows, globals_))

    @classmethod
    def thaw(cls, state: tuple) -> World:
        w = cls.__new__(cls)
        w._rows, (w.p_free, w.d_free, w.d_quar, p_content, d_content, w.d_ledger, w.faulted) = state
        w.p_content, w.d_content = list(p_content), list(d_content)
        w._touched = []
        w._ledger_cache = {}
        return w

    def __getattr__(self, name: str) -> list:
        index = _COLUMN.get(name)
        if index is None:
            raise AttributeError(name)
        column = list(self._rows[index])
        setattr(self, name, column)
        self._touched.append(index)
        return column

    def peek(self, name: str) -> list | tuple:
        """Read a column without thawing it."""
        index = _COLUMN[name]
        return getattr(self, name) if index in self._touched else self._rows[index]

    def freeze(self) -> tuple:
        for name, ledger in self._ledger_cache.items():
            setattr(self, name, ledger.snapshot())
        rows = self._rows
        if self._touched:
            rows = list(rows)
            for index in self._touched:
                rows[index] = tuple(getattr(self, PER_REQUEST[index]))
            rows = tuple(rows)
        globals_ = (
            self.p_free, self.d_free, self.d_quar, tuple(self.p_content), tuple(self.d_content),
            self.d_ledger, self.faulted,
        )  # fmt: skip
        return rows, globals_

    def ledger(self, name: str, num_pages: int):  # -> PageLedger (imported lazily by the policy)
        """The live ledger for ``name`` (decode's, 'd_ledger'), restored from the state on first use."""
        from sglang_harden.guards.lifecycle import PageLedger

        cached = self._ledger_cache.get(name)
        if cached is None:
            snap = getattr(self, name)
            cached = PageLedger(num_pages) if snap is None else PageLedger.restore(snap)
            self._ledger_cache[name] = cached
        return cached

    def record_error(self, r: int, status: int) -> None:
        if not self.error[r]:
            self.error[r] = status
