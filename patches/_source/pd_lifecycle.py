"""Page lifecycle on both PD roles (sglang-harden backport, not upstream SGLang code).

Invariant (sglang-harden's lifecycle guard): a decode KV page handed to a transfer goes back to the free list only
once no write into it can still land: the transfer reported success on every rank and was committed, every prefill
rank it was published to acknowledged that its writes drained, or that prefill is known gone. Until then the page
waits in quarantine; a bare timeout is no confirmation. Prefill acknowledges a drain only once no write of the room
can land: a write the transport gave up on may still land for ``SGLANG_HARDEN_TRANSFER_WRITE_LIFETIME_S`` seconds
(0: never by itself), so the acknowledgement waits that long after the failure.

decode
- ``note_published`` (the prealloc queue handed a request's destination pages to the transfer backend, after
  ``send_metadata``, any backend): the pages are reserved for ``room:<bootstrap_room>`` and being written;
- ``note_committed`` (the transfer queue is about to commit a transfer that reported Success): pages written;
- ``pages_to_free`` / ``page_ids_to_free`` (the token and paged allocators' free paths): a page still being written
  by a writer that has not drained is kept back (quarantine) and prefill is asked for its drain acknowledgement.
  The freed index lives on the GPU; the free is judged by why SGLang frees (``releasing`` around
  ``release_kv_cache``, ``evicting`` around the tree caches' evictions, ``group_begins`` / ``group_flush`` around
  the allocators' free groups): a request whose transfer may still write has its whole free kept back and the
  transfer's pages quarantined from the ledger's own copy of them; a committed request's free and an eviction pass
  (the ledger learns of them from a copy to pinned memory, without the scheduler waiting); only a free nobody can
  attribute while a transfer is in flight is read on the host (series without those edits: every such free);
- ``note_ack`` (``CommonKVManager.note_abort_ack``, with its generation on 0.5.22+) and ``note_sender_gone``
  (``_handle_node_failure``): drain evidence, from the receiver threads. An acknowledgement counts only for a live
  transfer of its room whose abort notice was armed (``note_abort_notice``, at the top of the receiver's
  ``_send_abort_notification``), at the generation that notice carries, from a prefill rank the transfer targets,
  once (sglang-harden's ``guards/drain_acks.py``); any other is counted (``dropped_acks``) and ignored;
- ``release_drained`` (``DecodeTransferQueue.pop_transferred``, the scheduler thread): quarantined pages whose
  writers drained go to the free list;
- ``quarantine_refusal`` (``DecodePreallocQueue.add``, a new request): at the quarantine cap it is refused with 503.
prefill
- ``ack_when_drained`` / ``ack_if_drained`` (releases without drain acknowledgements, 0.5.18's Mooncake manager):
  decode's abort notice is answered with an acknowledgement naming this prefill rank once no chunk of the room is
  in flight (the transfer worker counts a chunk before it looks at the room's status);
- ``note_failed_write`` (Mooncake's failed engine call; ``poison_deferred_ack_room`` on releases that have it, which
  would otherwise drop the room's acknowledgement target for good);
- ``ack_deferred`` (``CommonKVManager._send_abort_ack``): an acknowledgement of a room whose failed write may still
  land is sent by a timer once the write's lifetime passed.
Both roles: ``deferred_release`` turns SGLang's deferred decode KV release (prefill's drain acknowledgements) on.
releases with no abort notice at all (0.4.x Mooncake): this module carries both messages over the ZMQ sockets the
release already has (decode's notice to each prefill rank's bootstrap socket, prefill's acknowledgement to decode's)
- ``send_abort_notice_frames`` (decode, the receiver's ``_send_abort_notification``) and ``abort_notice_received``
  (prefill's bootstrap thread): prefill drops the room's KV chunks from then on and acknowledges once none is in
  flight;
- ``chunk_starts`` / ``chunk_done`` (prefill's transfer worker): a chunk is counted in flight before the worker
  looks at whether decode aborted its room;
- ``ack_frames_received`` (decode's receiver thread): an acknowledgement is drain evidence like ``note_ack``.
Malformed ``SGH_*`` frames are counted and dropped (the listener thread they arrive on keeps serving); prefill's
acknowledgement sockets are kept per decode endpoint, at most ``MAX_ACK_SOCKETS`` (least recently used closed).

The ledger and the rules are sglang-harden's own code (``guards/page_ledger.py``, ``guards/lifecycle.py``), put in
below when the series is generated, so a patched and a plugin node judge alike. ``SGLANG_HARDEN_LIFECYCLE``:
``enforce`` (default), ``log`` (log what would be quarantined or held, free and acknowledge as upstream does),
``off`` (no ledger, upstream's behaviour). Any other value refuses to start.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from enum import Enum

import numpy as np

logger = logging.getLogger(__name__)

MODE_ENV = "SGLANG_HARDEN_LIFECYCLE"
LIFETIME_ENV = "SGLANG_HARDEN_TRANSFER_WRITE_LIFETIME_S"
CAP_ENV = "SGLANG_HARDEN_QUARANTINE_CAP_PAGES"
DEFAULT_LIFETIME_S = 30
MAX_FAILED_ROOMS = 1 << 16  # prefill: rooms remembered with a failed write (the oldest age out past this)

# sglang-harden's native ledger library is not part of the backport: the ledger runs its numpy path.
NOT_HANDLED, DONE = 0, 1
LedgerOps = None


def ledger_library() -> None:
    return None


# <prelude>


# <bundle sglang_harden/guards/base.py sglang_harden/kernels/page_arrays.py sglang_harden/guards/page_ledger.py sglang_harden/guards/lifecycle.py sglang_harden/guards/drain_acks.py sglang_harden/compat/drain_ack.py sglang_harden/kernels/device.py sglang_harden/compat/free_context.py>


# ---- the backport's own glue: SGLang's objects in, the guard's decisions out


MODE = mode_from_env(MODE_ENV)


def _number_from_env(name: str, default: str, parse: Callable[[str], Any], expected: str) -> Any:
    """A non-negative number from ``name``; a bad value refuses to start, naming the variable."""
    raw = os.environ.get(name, "").strip() or default
    try:
        value = parse(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected {expected}") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r}: must not be negative")
    return value


LIFETIME_S = _number_from_env(LIFETIME_ENV, str(DEFAULT_LIFETIME_S), float,
                              "seconds (0: a failed write never expires)")
CAP_PAGES = _number_from_env(CAP_ENV, "0", int, "a page count (0: a quarter of the pool)")


def deferred_release(upstream: bool) -> bool:
    """SGLang's deferred decode KV release switch: on whenever the guard is (prefill then acknowledges drains)."""
    return True if MODE != "off" else upstream


def _as_pages(indices: Any) -> Any:
    """An index tensor or array as an int64 numpy array of its own (a CUDA tensor is copied to the host)."""
    import numpy as np

    if hasattr(indices, "detach"):
        indices = indices.detach().cpu().numpy()
    return np.array(indices, dtype=np.int64).reshape(-1)


class HeldFree:
    """A free SGLang asked for that the guard keeps back whole (a device-side copy of the index, never read)."""

    def __init__(self, release: Callable[[Any], Any], index: Any, tokens: int) -> None:
        self.release, self.index, self.tokens = release, index, tokens


class Transfer:
    """One request's transfer into decode's pages: who may write them and which acknowledgements end that."""

    def __init__(self, room: int, pages: Any, required_acks: int, addr: str, receiver: Any) -> None:
        self.room, self.pages, self.required_acks = room, pages, required_acks
        self.addr, self.receiver = addr, receiver


class DecodeLifecycle:
    """The page ledger of one decode scheduler's KV allocator, the transfers writing into it and their drain
    evidence (acknowledgements and gone senders arrive on receiver threads)."""

    def __init__(self, allocator: Any) -> None:
        self.allocator = allocator
        self.page_size = int(getattr(allocator, "page_size", 1) or 1)
        self.ledger = PageLedger(int(allocator.size) // self.page_size + 2, native=False)
        self.transfers: dict[str, Transfer] = {}
        self.held: dict[str, list[HeldFree]] = {}  # owner -> frees kept back until its writer drains
        self.learning = LandingQueue()  # frees that passed, on their way to the host
        self.acks = AckBook()  # the drain acknowledgements of the live transfers
        self._gone: set[str] = set()
        self._lock = threading.Lock()

    # ---- transfer path (scheduler thread)
    def publish(self, room: int, pages: Any, required_acks: int, addr: str, receiver: Any) -> str | None:
        """Reserve ``pages`` for the room's transfer; the reason it cannot, or None."""
        owner = f"room:{room}"
        self.apply_learned()
        try:
            self._reserve(owner, pages)
        except LedgerError as exc:
            return f"destination page not free in the page ledger when handed to the transfer: {exc}"
        self.transfers[owner] = Transfer(room, pages, required_acks, addr, receiver)
        # acknowledgements of an earlier use of this room are not this one's
        opened = self.acks.open(room, expected_ack_ranks(receiver), notice_sent(receiver),
                                lambda: notice_generation(receiver))
        if not opened.allows:
            _dropped(str(opened.fields["why"]), opened.reason)
        return None

    def _reserve(self, owner: str, pages: Any) -> None:
        try:
            self.ledger.reserve_bulk(owner, pages, PageState.WRITING, handed_over=True)
            return
        except LedgerError:
            if not self.learning:
                raise
        self.apply_learned(wait=True)  # a free not yet learned: wait for its copy (a rare host synchronisation)
        self.ledger.reserve_bulk(owner, pages, PageState.WRITING, handed_over=True)

    def commit(self, room: int) -> None:
        transfer = self.transfers.pop(f"room:{room}", None)
        if transfer is not None:
            self.acks.close(room)
            self.ledger.move_bulk(f"room:{room}", transfer.pages, PageState.WRITTEN)

    def in_flight(self, room: int | None) -> Transfer | None:
        """The room's transfer while a write into its pages may still come (published, not committed)."""
        return self.transfers.get(f"room:{room}") if room is not None else None

    def any_in_flight(self) -> bool:
        return bool(self.transfers)

    # ---- frees judged without reading the index (scheduler thread)
    def hold_release(self, owner: str, held: HeldFree) -> bool:
        """Quarantine the pages of ``owner``'s transfer (its host copy of them) and keep ``held`` back until the
        writer drains; False: nothing to keep (drained, or log mode)."""
        transfer = self.transfers.get(owner)
        if transfer is None:
            return False
        self._release(owner, transfer.pages)
        if MODE != "enforce" or owner not in self.ledger.quarantined_owners():
            return False
        self.held.setdefault(owner, []).append(held)
        return True

    def learn(self, index: Any) -> None:
        if index.numel():
            self.learning.add(HostCopy.launch([index]))
            self.apply_learned()

    def apply_learned(self, wait: bool = False) -> None:
        self.learning.drain(self._learn_freed, wait)

    def _learn_freed(self, pages: Any) -> None:
        for owner, owned in self.ledger.owner_groups(_as_pages(pages)):
            self.ledger.release_bulk(owner, owned, writer_drained=True)

    # ---- drain evidence (any thread)
    def note_ack(self, room: int, rank: int, generation: int | None = None) -> bool:
        """A prefill rank's drain acknowledgement; True when it counts (else it is counted as dropped)."""
        decision = self.acks.note(room, rank, generation)
        if decision.verdict is not Verdict.ALLOW:  # a duplicate too
            _dropped(str(decision.fields["why"]), decision.reason)
            return False
        return True

    def arm(self, receiver: Any) -> None:
        """``receiver`` is about to send its abort notice: its transfer's acknowledgements may come now."""
        transfer = self.transfers.get(f"room:{getattr(receiver, 'bootstrap_room', None)}")
        if transfer is not None and transfer.receiver is receiver:
            self.acks.arm(transfer.room)

    def note_gone(self, addr: str) -> None:
        with self._lock:
            self._gone.add(addr)

    def drained(self, owner: str) -> bool:
        transfer = self.transfers.get(owner)
        if transfer is None:
            return False
        acked = self.acks.count(transfer.room)  # targets unknown (required 0): only a gone sender drains it
        with self._lock:
            evidence = DrainEvidence(max(transfer.required_acks, acked.required), acked.acked,
                                     sender_gone=transfer.addr in self._gone)
        return writer_drained(evidence)

    # ---- free path (scheduler thread)
    def keep_back(self, pages: Any) -> Any:
        """Mask of ``pages`` that must not reach the free list, or None (free them all)."""
        groups = self.ledger.owner_groups(pages)
        if not groups:
            return None
        for owner, owned in groups:
            self._release(owner, owned)
        if not self.ledger.quarantined_count():
            return None
        held = self.ledger.state_array()[pages] == PageState.QUARANTINED
        return held if held.any() else None

    def _release(self, owner: str, pages: Any) -> None:
        drained = self.drained(owner)
        if MODE == "log" and not drained:
            writing = int((self.ledger.state_array()[pages] == PageState.WRITING).sum())
            if writing:
                logger.warning("sglang-harden lifecycle quarantine_logged (log mode: freed anyway): %s KV pages of %s "
                               "released while its transfer may still write them", writing, owner)
            drained = True
        outcome = self.ledger.release_bulk(owner, pages, writer_drained=drained)
        if len(outcome.to_quarantine):
            transfer = self.transfers.get(owner)
            logger.warning("sglang-harden lifecycle quarantine: %s KV pages of %s released while its transfer may "
                           "still write them; held until prefill %s acknowledges its writes drained (%s pages held)",
                           len(outcome.to_quarantine), owner, transfer.addr if transfer else "?",
                           self.ledger.quarantined_count())
            self._ask_for_ack(transfer)
        elif owner in self.transfers and not self.ledger.holds_pages(owner):
            self._forget(owner)

    def _ask_for_ack(self, transfer: Transfer | None) -> None:
        """Prefill acknowledges a drained room only after an abort notice from decode: make sure one went out."""
        if transfer is None:
            return
        self.acks.arm(transfer.room)  # before the notice: its acknowledgement may come back at once
        try:
            send_abort_notice(transfer.receiver)
        except Exception as exc:  # noqa: BLE001 - best effort: without an acknowledgement the pages stay held
            logger.warning("sglang-harden lifecycle: could not ask prefill to acknowledge room %s: %r",
                           transfer.room, exc)

    def _forget(self, owner: str) -> None:
        transfer = self.transfers.pop(owner, None)
        if transfer is not None:
            self.acks.close(transfer.room)

    # ---- leaving quarantine (scheduler thread)
    def drained_pages(self) -> tuple[list[HeldFree], list[int]]:
        """The frees kept back for writers that drained since the last call, and those writers' quarantined pages no
        kept-back free holds; the ledger already counts them free."""
        given_back: list[HeldFree] = []
        freed: list[int] = []
        for owner in self.ledger.quarantined_owners():
            if self.drained(owner):
                pages = self.ledger.confirm_drained(owner)
                logger.warning("sglang-harden lifecycle release: %s KV pages of %s leave quarantine (writer "
                               "drained)", len(pages), owner)
                held = self.held.pop(owner, None)
                if held is None:
                    freed.extend(pages)
                else:
                    given_back.extend(held)
                self._forget(owner)
        return given_back, freed


NODE: DecodeLifecycle | None = None


def _node_for(allocator: Any) -> DecodeLifecycle | None:
    node = NODE
    return node if node is not None and node.allocator is allocator else None


def note_published(allocator: Any, receiver: Any, page_indices: Any) -> None:
    """Decode handed ``page_indices`` (page numbers) of ``allocator`` to ``receiver``'s transfer."""
    global NODE

    room = getattr(receiver, "bootstrap_room", None)
    infos = getattr(receiver, "bootstrap_infos", None)
    if MODE == "off" or room is None or infos is None:
        return  # nothing was published: no writer for these pages
    if NODE is None or NODE.allocator is not allocator:
        NODE = DecodeLifecycle(allocator)
        logger.info("sglang-harden lifecycle: decode ledger over %s KV pages (page size %s), mode %s",
                    NODE.ledger.num_pages, NODE.page_size, MODE)
    reason = NODE.publish(int(room), _as_pages(page_indices), len(infos), str(getattr(receiver, "bootstrap_addr", "")),
                          receiver)
    if reason is not None:
        logger.error("sglang-harden lifecycle abort: room=%s: %s", room, reason)
        receiver.kv_mgr.record_failure(room, "sglang-harden lifecycle: " + reason)
        receiver.abort()


def note_committed(req: Any) -> None:
    """The transfer of ``req`` reported Success on every rank: its pages are written, no write can still land."""
    node = NODE
    room = getattr(req, "bootstrap_room", None)
    if node is not None and room is not None:
        node.commit(int(room))


def pages_to_free(allocator: Any, free_index: Any) -> Any:
    """The part of ``free_index`` (token slots of a page-size-1 allocator) that may go to the free list now."""
    node = _node_for(allocator)
    if node is None or free_index.numel() == 0:
        return free_index
    return _judged(node, free_index, lambda index: allocator.free(index), 1)


def page_ids_to_free(allocator: Any, page_ids: tuple) -> tuple:
    """``_release_page_ids``'s page id tensors without the pages that must stay in quarantine."""
    node = _node_for(allocator)
    if node is None:
        return page_ids
    return tuple(_judged(node, ids, lambda index: allocator._release_page_ids(index), node.page_size)
                 if ids.numel() else ids for ids in page_ids)


def _judged(node: DecodeLifecycle, index: Any, release: Callable[[Any], Any], token_scale: int) -> Any:
    """What of ``index`` (page numbers) may be freed now, decided by why it is freed (``route``)."""
    action = route(node)
    if action == HOLD:
        transfer = node.in_flight(room_of(current().req))
        held = HeldFree(release, index.clone(), int(index.numel()) * token_scale)
        if transfer is not None and node.hold_release(f"room:{transfer.room}", held):
            return index[:0]
    if action != READ:
        node.learn(index)
        return index
    pages = _as_pages(index)
    keep = node.keep_back(pages)
    if keep is None:
        return index
    return index.index_select(0, upload(np.flatnonzero(~keep), index))


def _give_back(node: DecodeLifecycle, given_back: list[HeldFree], loose: list[int]) -> None:
    """Free what was kept back: the kept frees as they were, loose pages uploaded without blocking; the guard's own
    frees pass its free path unjudged."""
    with marked(FreeContext(VETTED)):
        for held in given_back:
            held.release(held.index)
        if not loose:
            return
        allocator = node.allocator
        index = _device_index(allocator, loose)
        if node.page_size == 1:
            allocator.free(index)
        elif hasattr(allocator, "_release_page_ids"):
            allocator._release_page_ids(index)
        else:  # to 0.5.12 the paged allocator frees token slots (the pages they are on)
            allocator.free(index * node.page_size)


def releases_request(func: Callable[..., Any]) -> Callable[..., Any]:
    """``release_kv_cache(req, tree_cache, ...)``: the frees inside are ``req``'s."""

    @functools.wraps(func)
    def release_kv_cache(req: Any, *args: Any, **kwargs: Any) -> Any:
        with releasing(req):
            return func(req, *args, **kwargs)

    return release_kv_cache


def caches_request(func: Callable[..., Any]) -> Callable[..., Any]:
    """A tree cache's caching of an unfinished request (``method(self, req, ...)``): the frees inside are ``req``'s."""

    @functools.wraps(func)
    def method(self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        with marked(FreeContext(REQUEST, req)):
            return func(self, req, *args, **kwargs)

    return method


def evicts(func: Callable[..., Any]) -> Callable[..., Any]:
    """A tree cache's eviction: the frees inside are finished requests' pages."""

    @functools.wraps(func)
    def method(*args: Any, **kwargs: Any) -> Any:
        with evicting():
            return func(*args, **kwargs)

    return method


def begins_free_group(func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)
    def free_group_begin(*args: Any, **kwargs: Any) -> Any:
        result = func(*args, **kwargs)
        group_begins()
        return result

    return free_group_begin


def ends_free_group(func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)
    def free_group_end(*args: Any, **kwargs: Any) -> Any:
        with group_flush():
            return func(*args, **kwargs)

    return free_group_end


def _device_index(allocator: Any, pages: list[int]) -> Any:
    """``pages`` as an index on the allocator's device, uploaded from pinned memory without blocking."""
    like = getattr(allocator, "free_pages", None)
    if like is not None:
        return upload(np.asarray(pages, dtype=np.int64), like, like.dtype)
    import torch

    return torch.tensor(pages, dtype=torch.int64, device=allocator.device)


@contextmanager
def releasing(req: Any) -> Iterator[None]:
    """``release_kv_cache`` of ``req``: the frees inside are that request's."""
    note_release(NODE, req)
    with marked(FreeContext(REQUEST, req)):
        yield


@contextmanager
def evicting() -> Iterator[None]:
    """A tree cache's eviction: the frees inside are finished requests' pages."""
    with marked(FreeContext(EVICT)):
        yield


@contextmanager
def group_flush() -> Iterator[None]:
    """An allocator's ``free_group_end``: the frees inside are the group's."""
    context = group_flush_context()
    if context is None:
        yield
        return
    with marked(context):
        yield


def release_drained() -> None:
    """Scheduler thread: hand the frees and pages kept back for writers that drained back to the allocator."""
    node = NODE
    if node is None:
        return
    node.apply_learned()
    if not node.ledger.quarantined_count():
        return
    given_back, loose = node.drained_pages()
    _give_back(node, given_back, loose)


def note_ack(room: int, rank: int, generation: int | None = None) -> None:
    """Decode's receiver thread: prefill rank ``rank`` acknowledged that its writes of ``room`` drained
    (``generation``: the one its acknowledgement names, 0.5.22+)."""
    node = NODE
    if node is not None:
        node.note_ack(int(room), int(rank), None if generation is None else int(generation))


def note_abort_notice(receiver: Any) -> None:
    """Decode: ``receiver``'s abort notice is about to go out; acknowledgements of its transfer may come from now
    on (before the send: one can come back before the receiver records that it notified)."""
    node = NODE
    if node is not None:
        node.arm(receiver)


def ranked_ack_received(frames: list) -> None:
    """Decode's receiver thread (0.5.18): upstream's ``[ABORT_ACK, room, prefill rank]``, the rank-naming
    acknowledgement this module's prefill sends; a malformed one is counted and dropped."""
    ack = _parsed_ack(frames)
    if ack is None:
        _dropped("malformed_ack", f"{len(frames)} frames")
        return
    note_ack(*ack)


# acknowledgements and notices not acted on, by why (drain_acks' reasons, malformed frames)
_DROPPED: dict[str, int] = {}
_DROPPED_LOCK = threading.Lock()


def _dropped(why: str, detail: str) -> None:
    """Count an acknowledgement or notice this module ignored; logged at the 1st, 2nd, 4th, 8th … of each kind."""
    with _DROPPED_LOCK:
        count = _DROPPED[why] = _DROPPED.get(why, 0) + 1
    if count & (count - 1) == 0:
        logger.warning("sglang-harden lifecycle drain_ack_dropped (%s, %s so far): %s", why, count, detail)


def dropped_acks() -> dict[str, int]:
    """How many acknowledgements and notices were ignored so far, by why."""
    with _DROPPED_LOCK:
        return dict(_DROPPED)


MAX_FRAME_DIGITS = 20


def _frame_int(frame: Any, limit: int = 1 << 63) -> int | None:
    """An ASCII decimal frame (digits only) as an int below ``limit``, or None."""
    try:
        text = bytes(frame).decode("ascii")
    except (TypeError, ValueError):
        return None
    if not text.isdigit() or len(text) > MAX_FRAME_DIGITS:
        return None
    value = int(text)
    return value if value < limit else None


_HOST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_:[]%")


def _frame_host(frame: Any) -> str | None:
    """A host name or IP address frame, or None."""
    try:
        text = bytes(frame).decode("ascii")
    except (TypeError, ValueError):
        return None
    return text if 0 < len(text) <= 255 and set(text) <= _HOST_CHARS else None


def _parsed_ack(frames: list) -> tuple[int, int] | None:
    """(room, rank) of a three-frame acknowledgement ``[tag, room, rank]``, or None."""
    if len(frames) != 3:
        return None
    room, rank = _frame_int(frames[1]), _frame_int(frames[2], 1 << 31)
    return None if room is None or rank is None else (room, rank)


def note_sender_gone(addr: str) -> None:
    node = NODE
    if node is not None:
        node.note_gone(str(addr))


def quarantine_refusal() -> str | None:
    """Why decode must refuse a new request now (HTTP 503), or None: at the quarantine cap
    (``SGLANG_HARDEN_QUARANTINE_CAP_PAGES``, 0: a quarter of the pool) a node stops admitting rather than let
    requests wait on pages that may never come back."""
    node = NODE
    if node is None or MODE != "enforce":
        return None
    decision = node.ledger.admission_open(CAP_PAGES)
    if decision.allows:
        return None
    logger.warning("sglang-harden lifecycle reject (503): %s", decision.reason)
    return "sglang-harden: " + decision.reason


def held_tokens() -> int:
    """Token slots of decode's pool kept back (SGLang's idle pool check counts them as held): the frees kept back
    whole, and quarantined pages no kept-back free holds."""
    node = NODE
    if node is None:
        return 0
    kept = sum(held.tokens for frees in node.held.values() for held in frees)
    loose = sum(len(node.ledger.quarantined_pages(owner)) for owner in node.ledger.quarantined_owners()
                if owner not in node.held)
    return kept + loose * node.page_size


def quarantined_pages() -> int:
    node = NODE
    return node.ledger.quarantined_count() if node is not None else 0


# ---- prefill: acknowledgements wait for a failed write's lifetime


_FAILED_AT: dict[int, float] = {}
_FAILED_LOCK = threading.Lock()


def note_failed_write(room: int) -> bool:
    """The transport gave up on a write of ``room`` that may still land. True when the guard takes it over (the
    caller keeps the room's acknowledgement target instead of dropping it)."""
    if MODE == "off":
        return False
    with _FAILED_LOCK:
        _FAILED_AT.pop(int(room), None)
        _FAILED_AT[int(room)] = time.monotonic()
        while len(_FAILED_AT) > MAX_FAILED_ROOMS:
            _FAILED_AT.pop(next(iter(_FAILED_AT)))
    wait = f"{LIFETIME_S:g} s" if LIFETIME_S > 0 else "until the sender is gone (lifetime 0)"
    logger.warning("sglang-harden lifecycle: a KV write of room %s failed and may still land; its drain "
                   "acknowledgement waits %s", room, wait)
    return MODE == "enforce"


def ack_deferred(room: int, send: Callable[[], Any]) -> bool:
    """True when the acknowledgement of ``room`` must wait (``send`` is then called again once it may go)."""
    with _FAILED_LOCK:
        failed_at = _FAILED_AT.get(int(room))
    if failed_at is None or MODE == "off":
        return False
    age = time.monotonic() - failed_at
    evidence = SourceEvidence(chunks_outstanding=0, transfer_ended=True, failed_write_age_s=age)
    if source_settled(evidence, LIFETIME_S):
        with _FAILED_LOCK:
            _FAILED_AT.pop(int(room), None)
        return False
    if MODE == "log":
        logger.warning("sglang-harden lifecycle ack_logged (log mode: sent anyway): room %s acknowledged %.1f s "
                       "after a failed write", room, age)
        return False
    if LIFETIME_S > 0:
        timer = threading.Timer(LIFETIME_S - age + 0.05, send)
        timer.daemon = True
        timer.start()
    logger.warning("sglang-harden lifecycle hold_ack: room %s: drain acknowledgement held %.1f s more (a failed "
                   "write may still land)", room, max(LIFETIME_S - age, 0.0))
    return True


def settle_ack_target(manager: Any, room: int) -> None:
    """Prefill, the sender's ``clear()`` of a concluded room (0.5.19, 0.5.20): upstream drops the room's drain-ack
    target there even while a chunk is still being written, so the transfer worker finds no target when the write
    drains and decode never gets its acknowledgement (its pages wait out the release timeout, then quarantine for
    good). Enforce: the target stays while a chunk is outstanding (the worker acknowledges when it drains) and with
    none outstanding the room is acknowledged now (nothing of it can still land; a failed write's lifetime still
    applies, ``ack_deferred``). Log and off: upstream's drop."""
    if MODE != "enforce" or not hasattr(manager, "_staging_outstanding"):
        manager._deferred_ack_targets.pop(room, None)
        return
    manager._maybe_ack_drained_abort(room)


# ---- prefill on releases without drain acknowledgements (0.5.18 Mooncake): this module sends them

_ACK_TARGETS: dict[tuple[int, int], tuple[str, int]] = {}
_ACK_LOCK = threading.Lock()


def ack_when_drained(manager: Any, room: int, decode_ip: str, decode_port: int) -> bool:
    """Decode's abort notice for ``room`` arrived (the room is already marked failed): acknowledge once the room's
    writes drained, now or from the transfer worker. True: handled here (the caller skips its own acknowledgement,
    which would not say whether anything is still being written)."""
    if MODE == "off":
        return False
    with _ACK_LOCK:
        _ACK_TARGETS[(id(manager), int(room))] = (decode_ip, int(decode_port))
    ack_if_drained(manager, room)  # the worker may have finished the room's last chunk before the target existed
    return True


def ack_if_drained(manager: Any, room: int) -> None:
    """Transfer worker (a chunk of ``room`` finished or was skipped) or abort handler: send the pending
    acknowledgement of ``room`` if no chunk of it is in flight; at most once."""
    if _chunks_in_flight(manager, room) > 0:
        return
    with _ACK_LOCK:
        target = _ACK_TARGETS.pop((id(manager), int(room)), None)
    if target is not None:
        send_drain_ack(manager, int(room), *target)


def send_drain_ack(manager: Any, room: int, decode_ip: str, decode_port: int) -> None:
    """``ABORT_ACK <room> <prefill rank>`` to decode; held while a failed write of the room may still land."""
    if ack_deferred(room, lambda: send_drain_ack(manager, room, decode_ip, decode_port)):
        return
    if not hasattr(manager, "_send_multipart_locked"):  # 0.4.x: the acknowledgement this module defines
        _send_ack_frames(manager, room, decode_ip, decode_port)
        return
    from sglang.srt.utils.network import NetworkAddress

    rank = prefill_ack_rank(manager)
    try:
        address = NetworkAddress(decode_ip, decode_port)
        manager._send_multipart_locked(address.to_tcp(), [b"ABORT_ACK", str(room).encode("ascii"),
                                                           str(rank).encode("ascii")], is_ipv6=address.is_ipv6)
    except Exception as exc:  # noqa: BLE001 - without it decode keeps the pages held (safe), so say it
        logger.warning("sglang-harden lifecycle: drain acknowledgement of room %s to %s:%s failed: %r",
                       room, decode_ip, decode_port, exc)


# ---- releases with no abort notice at all (0.4.x Mooncake): both messages are this module's

ABORT_NOTICE = b"SGH_ABORT"  # decode -> each prefill rank: room, decode ip, decode port (4 frames, as 0.4.x's own)
ACK_NOTICE = b"SGH_ABORT_ACK"  # prefill rank -> decode: room, prefill rank (3 frames, as 0.4.x's status message)
_ABORTED: dict[tuple[int, int], None] = {}  # (id(manager), room): decode aborted it (oldest age out)
_CHUNKS: dict[tuple[int, int], int] = {}  # (id(manager), room): chunks the transfer worker holds
MAX_ACK_SOCKETS = 256  # prefill: acknowledgement sockets kept open, one per decode endpoint (least recent closed)
ACK_LINGER_MS = 1000  # a closed socket's queued acknowledgement still has this long to go out
_ACK_SOCKETS: OrderedDict[str, Any] = OrderedDict()
_SOCKETS_LOCK = threading.Lock()


def _chunks_in_flight(manager: Any, room: int) -> int:
    counts = getattr(manager, "_staging_outstanding", None)  # 0.5.18 counts its chunks itself
    if counts is not None:
        return int(counts.get(room, 0))
    with _ACK_LOCK:
        return _CHUNKS.get((id(manager), int(room)), 0)


def send_abort_notice_frames(receiver: Any) -> None:
    """Decode: tell every prefill rank of the receiver's room to stop writing it and to acknowledge its drain."""
    mgr = receiver.kv_mgr
    note_abort_notice(receiver)
    frames = [ABORT_NOTICE, str(receiver.bootstrap_room).encode("ascii"), str(mgr.local_ip).encode("ascii"),
              str(mgr.rank_port).encode("ascii")]
    for info in receiver.bootstrap_infos:
        sock, lock = receiver._connect_to_bootstrap_server(info)
        with lock:
            sock.send_multipart(frames)


def abort_notice_received(manager: Any, frames: list) -> bool:
    """Prefill's bootstrap thread: True when ``frames`` is decode's abort notice (handled here: from now on the
    room's chunks are dropped, and decode is acknowledged once none of them is in flight)."""
    if not frames or frames[0] != ABORT_NOTICE:
        return False
    notice = _parsed_notice(frames)
    if notice is None:
        _dropped("malformed_notice", f"{len(frames)} frames")
        return True
    if MODE == "off":
        return True
    try:
        _abort_noticed(manager, *notice)
    except Exception as exc:  # noqa: BLE001 - the bootstrap thread must keep serving; the room stays as it was
        _dropped("notice_failed", f"room {notice[0]}: {exc!r}")
    return True


def _parsed_notice(frames: list) -> tuple[int, str, int] | None:
    """(room, decode ip, decode port) of ``[SGH_ABORT, room, ip, port]``, or None."""
    if len(frames) != 4:
        return None
    room, decode_ip, decode_port = _frame_int(frames[1]), _frame_host(frames[2]), _frame_int(frames[3], 65536)
    if room is None or decode_ip is None or not decode_port:
        return None
    return room, decode_ip, decode_port


def _abort_noticed(manager: Any, room: int, decode_ip: str, decode_port: int) -> None:
    with _ACK_LOCK:
        _ABORTED[(id(manager), room)] = None
        while len(_ABORTED) > MAX_FAILED_ROOMS:
            _ABORTED.pop(next(iter(_ABORTED)))
    logger.warning("sglang-harden lifecycle: decode %s:%s aborted room %s; its KV chunks are dropped, the drain is "
                   "acknowledged once none is in flight", decode_ip, decode_port, room)
    _fail_room(manager, room)
    ack_when_drained(manager, room, decode_ip, decode_port)
    return True


def chunk_starts(manager: Any, room: int) -> bool:
    """Prefill's transfer worker took a chunk of ``room``: count it in flight, then True when decode aborted the room
    (the caller drops the chunk and calls ``chunk_done``)."""
    if MODE == "off":
        return False
    key = (id(manager), int(room))
    with _ACK_LOCK:
        _CHUNKS[key] = _CHUNKS.get(key, 0) + 1
        aborted = key in _ABORTED
    if aborted:
        _fail_room(manager, room)
        manager.transfer_infos.pop(int(room), None)
    return aborted


def chunk_done(manager: Any, room: int) -> None:
    """Prefill's transfer worker is done with a chunk of ``room`` (sent, failed or dropped)."""
    if MODE == "off":
        return
    key = (id(manager), int(room))
    with _ACK_LOCK:
        left = _CHUNKS.get(key, 0) - 1
        if left > 0:
            _CHUNKS[key] = left
        else:
            _CHUNKS.pop(key, None)
    ack_if_drained(manager, room)


def _fail_room(manager: Any, room: int) -> None:
    from sglang.srt.disaggregation.base import KVPoll

    if int(room) in manager.request_status:
        manager.record_failure(int(room), "sglang-harden lifecycle: aborted by decode")
        manager.update_status(int(room), KVPoll.Failed)


def _ack_socket(zmq: Any, endpoint: str, ipv6: bool) -> Any:
    """The acknowledgement socket to ``endpoint`` (under ``_SOCKETS_LOCK``): this module's own, SGLang's are used
    from its worker threads unlocked. At most ``MAX_ACK_SOCKETS``: the least recently used is closed."""
    sock = _ACK_SOCKETS.get(endpoint)
    if sock is not None:
        _ACK_SOCKETS.move_to_end(endpoint)
        return sock
    sock = zmq.Context.instance().socket(zmq.PUSH)
    try:
        sock.setsockopt(zmq.LINGER, ACK_LINGER_MS)
        if ipv6:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(endpoint)
    except Exception:
        sock.close(linger=0)
        raise
    _ACK_SOCKETS[endpoint] = sock
    while len(_ACK_SOCKETS) > MAX_ACK_SOCKETS:
        _ACK_SOCKETS.popitem(last=False)[1].close()
    return sock


def _send_ack_frames(manager: Any, room: int, decode_ip: str, decode_port: int) -> None:
    import zmq

    ipv6 = ":" in decode_ip
    endpoint = f"tcp://[{decode_ip}]:{decode_port}" if ipv6 else f"tcp://{decode_ip}:{decode_port}"
    frames = [ACK_NOTICE, str(room).encode("ascii"), str(prefill_ack_rank(manager)).encode("ascii")]
    try:
        with _SOCKETS_LOCK:  # never blocks: a full pipe (decode not reading) drops the acknowledgement
            _ack_socket(zmq, endpoint, ipv6).send_multipart(frames, flags=zmq.NOBLOCK)
    except Exception as exc:  # noqa: BLE001 - without it decode keeps the pages held (safe), so say it
        logger.warning("sglang-harden lifecycle: drain acknowledgement of room %s to %s failed: %r", room, endpoint, exc)


def ack_frames_received(frames: list) -> bool:
    """Decode's receiver thread: True when ``frames`` is a prefill rank's drain acknowledgement (recorded here if
    it counts; a malformed one is counted and dropped)."""
    if not frames or frames[0] != ACK_NOTICE:
        return False
    ack = _parsed_ack(frames)
    if ack is None:
        _dropped("malformed_ack", f"{len(frames)} frames")
        return True
    note_ack(*ack)
    return True
