"""Page lifecycle and page ownership tags on SGLang 0.5.19 … 0.5.23 (Mooncake, NIXL; MORI from 0.5.22).

Decode keeps a :class:`~sglang_harden.guards.lifecycle.PageLedger`, prefill a page -> room column of the
source pages its transfers read; both are fed from SGLang's own choke points:

decode
  * ``MooncakeKVReceiver.send_metadata(kv_indices, …)`` / ``NixlKVReceiver.send_metadata``: the request's
    destination pages leave this node -> ``reserve`` + ``begin_write`` (owner ``room:<bootstrap_room>``);
  * ``DecodeTransferQueue._commit_transfer_to_req``: the transfer reported Success on every rank ->
    ``finish_write``, then the page-tag check of the request's page table (abort, never generate);
  * the allocator's free (``TokenToKVPoolAllocator.free``, ``PagedTokenToKVPoolAllocator._release_page_ids``):
    every page SGLang frees passes the ledger; a page a writer may still write is kept back (quarantine)
    unless the writer confirmed it drained;
  * ``CommonKVManager.note_abort_ack`` (prefill's drain acknowledgement, counted only as
    ``guards.drain_acks`` allows: live transfer, the notice's generation, a targeted rank, once; armed by
    ``CommonKVReceiver._send_abort_notification``) and ``_handle_node_failure`` (the sender is gone): the only
    ways out of quarantine, applied on the scheduler thread at the next ``pop_transferred``;
  * ``DecodePreallocQueue.add``: at the quarantine cap new PD requests get HTTP 503.

prefill
  * ``MooncakeKVManager.add_transfer_request`` / ``NixlKVManager.add_transfer_request``: the chunk's source
    pages are held for its room;
  * the allocator's free keeps held pages back until the room settled (no chunk dequeued or in flight, and
    the room concluded or gone); ``process_disagg_prefill_inflight_queue`` releases settled rooms;
  * a write the transport gave up on may still land (``MooncakeKVManager.send_kvcache`` returned non-zero,
    ``NixlKVManager.send_kvcache`` raised because the post failed, or, on pins that have it,
    ``CommonKVManager.poison_deferred_ack_room``: the backend itself says it cannot prove the room drained):
    the room is unsettled for ``transfer_write_lifetime_s``, its drain-ack target is kept (upstream drops a
    poisoned room's target and never acks it), and the ack goes out once the lifetime passed.

Both roles: ``Scheduler.__init__`` makes prefill send drain acknowledgements
(``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE=1``) and bounds each Mooncake transfer batch to
``transfer_window_pages`` pages (``SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES`` where the pin has it, else
``send_kvcache`` is split here; NIXL and MORI transfers are not windowed). Each backend's own hooks are in
``compat/backends/``; any other backend refuses to start while the lifecycle guard is on. All decisions come
from ``guards.lifecycle`` and ``guards.page_tags``.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from sglang_harden import events
from sglang_harden.compat import commit_chain, free_path_v05
from sglang_harden.compat.abort_v05 import abort_and_stream
from sglang_harden.compat.hooks import PAGE_LEDGER_OWNER, Hook
from sglang_harden.compat.internals import (
    ALLOC_PAGED,
    ALLOC_TOKEN,
    CONN,
    DECODE_DOOR,
    INVARIANTS,
    NOTE_ABORT_ACK,
    POP_TRANSFERRED,
    PREFILL,
    SCHEDULER,
    SEND_ABORT_NOTICE,
)
from sglang_harden.compat.lifecycle_nodes import (
    PUBLISHED,
    DecodeNode,
    _kv_poll,
)
from sglang_harden.compat.prefill_node import PrefillNode
from sglang_harden.compat.runtime import RUNTIME
from sglang_harden.compat.shared import role_of
from sglang_harden.config import Mode
from sglang_harden.guards import lifecycle
from sglang_harden.guards.base import Decision, Verdict, allow
from sglang_harden.kernels.device import EventThen

logger = logging.getLogger("sglang_harden")

Func = Callable[..., Any]


DEFERRED_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"
WINDOW_ENV = "SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES"
# the ALLOW decisions of a transfer's hot path, made once (the hooks' log lines carry the room / rid)
PUBLISHED_TALLY = events.Tally(PUBLISHED)
ADMITTED_TALLY = events.Tally(allow(lifecycle.GUARD))  # the quarantine door let a new request in


NODE: DecodeNode | PrefillNode | None = None


free_path_v05.read_node_from(lambda: NODE)


def node_report() -> dict[str, Any] | None:
    return NODE.report() if NODE is not None else None


# ---------------------------------------------------------------- start-up (both roles)


def _scheduler_init(original: Func) -> Func:
    def init(self: Any, server_args: Any, port_args: Any, *args: Any, **kwargs: Any) -> Any:
        ledger_only = RUNTIME.config.lifecycle is Mode.OFF  # armed for the page-tag guard alone
        if not ledger_only:
            _process_env(str(getattr(server_args, "disaggregation_mode", "null")))
        result = original(self, server_args, port_args, *args, **kwargs)
        _make_node(self, ledger_only)
        return result

    return init


def _process_env(mode: str) -> None:
    """Drain acks from prefill, bounded transfer batches: both read from the environment by SGLang."""
    if mode == "null":
        return
    if os.environ.get(DEFERRED_ENV, "").lower() in ("0", "false"):
        logger.warning("sglang-harden lifecycle: %s=0 overridden: prefill must acknowledge drains", DEFERRED_ENV)
    os.environ[DEFERRED_ENV] = "1"
    window = RUNTIME.config.transfer_window_pages
    if window > 0 and os.environ.get(WINDOW_ENV, "0") in ("", "0"):
        os.environ[WINDOW_ENV] = str(window)


def _make_node(scheduler: Any, ledger_only: bool = False) -> None:
    """The role's node; ``ledger_only`` (lifecycle off, page tags on): decode's ledger only, no prefill node."""
    global NODE

    role = role_of(scheduler)
    if ledger_only and role != "decode":
        return
    allocator = scheduler.token_to_kv_pool_allocator
    if role == "decode":
        NODE = DecodeNode.for_allocator(allocator, RUNTIME.config.quarantine_cap_pages)
        RUNTIME.writer_never_started = NODE.note_never_started
    elif role == "prefill":
        NODE = PrefillNode.for_allocator(allocator)
        NODE.lifetime_s = float(RUNTIME.config.transfer_write_lifetime_s)
    if NODE is not None:
        logger.warning("sglang-harden lifecycle: %s ledger over %s pages (page size %s), window %s pages",
                       role, NODE.num_pages, NODE.page_size, RUNTIME.config.transfer_window_pages)


# ---------------------------------------------------------------- decode transfer path


def _send_metadata(original: Func) -> Func:
    def send_metadata(self: Any, kv_indices: Any, *args: Any, **kwargs: Any) -> Any:
        node = NODE
        if not isinstance(node, DecodeNode) or self.bootstrap_room is None:
            return original(self, kv_indices, *args, **kwargs)
        result = original(self, kv_indices, *args, **kwargs)
        if getattr(self, "bootstrap_infos", None) is None:
            return result  # nothing was published: no writer for these pages
        pages = np.array(kv_indices, dtype=np.int64)  # the ledger's own copy (see DecodeNode.begin)
        decision = node.begin(int(self.bootstrap_room), str(self.bootstrap_addr), len(self.bootstrap_infos),
                              pages, self)
        if decision is PUBLISHED:
            PUBLISHED_TALLY.bump(RUNTIME.config.lifecycle, room=self.bootstrap_room)
        elif events.record(decision, RUNTIME.config.lifecycle, room=self.bootstrap_room):
            self.kv_mgr.record_failure(self.bootstrap_room, decision.reason)
            self.abort()
        return result

    return send_metadata


def _finish_transfer(_queue: Any, decode_req: Any, context: dict[str, Any]) -> bool:
    """Commit-chain step: the ledger learns the transfer finished (its pages written) before SGLang commits the
    request; its record goes to the page-tag step in ``context``."""
    node = NODE
    room = getattr(decode_req.req, "bootstrap_room", None)
    context["transfer"] = node.finish(int(room)) if isinstance(node, DecodeNode) and room is not None else None
    return False


def _confirmations_first(original: Func) -> Func:
    def pop_transferred(self: Any, *args: Any, **kwargs: Any) -> Any:
        node = NODE
        if isinstance(node, DecodeNode):
            node.apply_learned()
            if node.ledger.quarantined_count():
                given_back, loose = node.confirmations()
                free_path_v05.give_back(given_back)
                free_path_v05.free_loose_pages(node, loose)
        return original(self, *args, **kwargs)

    return pop_transferred


def _note_ack(original: Func) -> Func:
    """Prefill's drain ack, before SGLang's own accounting (which it still gets unchanged): the node counts it
    only for a live transfer of the room whose notice carried the ack's generation (0.5.22+), from a rank the
    transfer targets, once (``guards.drain_acks``). SGLang's tracker is not the reference: its release timeout
    clears the room while the node may still hold the pages."""
    numbered = "generation" in inspect.signature(original).parameters  # 0.5.22+

    def note_abort_ack(self: Any, bootstrap_room: int, prefill_rank: int, *args: Any, **kwargs: Any) -> Any:
        node = NODE
        if isinstance(node, DecodeNode):
            generation = (args[0] if args else kwargs.get("generation")) if numbered else None
            node.note_ack(bootstrap_room, prefill_rank, generation)
        return original(self, bootstrap_room, prefill_rank, *args, **kwargs)

    return note_abort_ack


def _arm_drain_acks(original: Func) -> Func:
    """Decode's abort notice is about to go out (whoever sends it: SGLang's abort or timeout, or the guard asking
    for its ack): from now on the transfer's acks may count. Marked before the send, as an ack can come back
    before SGLang sets ``abort_notified``."""

    def send_abort_notification(self: Any, *args: Any, **kwargs: Any) -> Any:
        node = NODE
        if isinstance(node, DecodeNode):
            node.arm(self)
        return original(self, *args, **kwargs)

    return send_abort_notification


def _note_gone(original: Func) -> Func:
    def handle_node_failure(self: Any, failed_bootstrap_addr: str, *args: Any, **kwargs: Any) -> Any:
        node = NODE
        if isinstance(node, DecodeNode):
            node.note_gone(str(failed_bootstrap_addr))
        return original(self, failed_bootstrap_addr, *args, **kwargs)

    return handle_node_failure


def _quarantine_door(original: Func) -> Func:
    """At the quarantine cap a new PD request is refused with 503 instead of waiting on unsafe pages."""

    def add(self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        node = NODE
        retracted = bool(args[0]) if args else bool(kwargs.get("is_retracted", False))
        if not isinstance(node, DecodeNode) or retracted:
            return original(self, req, *args, **kwargs)
        room = getattr(req, "bootstrap_room", None)
        if node.ledger.quarantined_count() < node.quarantine_cap:
            ADMITTED_TALLY.bump(RUNTIME.config.lifecycle, room=room)
            return original(self, req, *args, **kwargs)
        decision = node.ledger.admission_open(node.cap)
        if events.record(decision, RUNTIME.config.lifecycle, room=room):
            abort_and_stream(self.scheduler, req, "sglang-harden: " + decision.reason, 503)
            return None
        return original(self, req, *args, **kwargs)

    return add


# ---------------------------------------------------------------- prefill source hold


def _hold_sources(original: Func) -> Func:
    """The chunk's source pages are held for its room. From 0.5.21 SGLang hands the indices over while it is still
    copying them to pinned host memory (``indices_event`` completes the copy; its transfer worker waits for it):
    they are read once the event is seen complete, never before."""

    def add_transfer_request(self: Any, bootstrap_room: int, kv_indices: Any, *args: Any, **kwargs: Any) -> Any:
        node = NODE
        if isinstance(node, PrefillNode) and _will_enqueue(self, bootstrap_room):
            event = kwargs.get("indices_event")
            if event is not None:
                read = node.hold_unread(self, int(bootstrap_room), kv_indices, event)
                kwargs["indices_event"] = EventThen(event, read)
            else:
                node.hold(self, int(bootstrap_room), _host_pages(kv_indices))
        return original(self, bootstrap_room, kv_indices, *args, **kwargs)

    return add_transfer_request


def _host_pages(kv_indices: Any) -> np.ndarray:
    """The node's own int64 copy of page indices SGLang holds on the host (numpy, or a host tensor)."""
    if isinstance(kv_indices, np.ndarray):
        return kv_indices.astype(np.int64, copy=True)
    return free_path_v05._pages_of(kv_indices, 1).copy()


def chunks_queued(room: int) -> bool:
    """Whether a KV chunk of ``room`` was handed to this prefill's transfer engine (and its sources not yet
    let go). Without a prefill node (lifecycle off) nobody knows: True."""
    node = NODE
    if not isinstance(node, PrefillNode):
        return True
    return node.chunks_queued(room)


def _will_enqueue(mgr: Any, room: int) -> bool:
    status = mgr.request_status.get(room)
    return status is not None and status != _kv_poll().failed and room in mgr.transfer_infos


def _settle_after_inflight(original: Func) -> Func:
    def process(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        node = NODE
        if isinstance(node, PrefillNode) and node.busy():
            free_path_v05.free_loose_pages(node, node.settle_pending())
            free_path_v05.give_back(node.take_given_back())
        return result

    return process


def _keep_ack_target(original: Func) -> Func:
    """SGLang's sender.clear() drops a room's drain-ack target (0.5.19: even while a chunk is still being
    written, so decode never gets its ack). Keep it until the room settled, then send the ack ourselves."""

    def clear(self: Any, *args: Any, **kwargs: Any) -> Any:
        node = NODE
        room = getattr(self, "bootstrap_room", None)
        if isinstance(node, PrefillNode) and room is not None:
            target = getattr(self.kv_mgr, "_deferred_ack_targets", {}).get(room)
            node.kv_mgr = node.kv_mgr or self.kv_mgr
            if target is not None and not node.settled(int(room)):
                node.keep_ack_target(int(room), target)
        return original(self, *args, **kwargs)

    return clear


def _capture_ack_target(original: Func) -> Func:
    """0.5.23 "poisons" a room whose engine call failed (the batch may still be writing) and then never acks
    it, so decode's only exit is its release timeout. Keep the target; after the write lifetime we ack."""
    signature = inspect.signature(original)

    def register(self: Any, room: int, *args: Any, **kwargs: Any) -> Any:
        node = NODE
        if isinstance(node, PrefillNode) and node.write_failed(int(room)):
            bound = signature.bind(self, room, *args, **kwargs).arguments
            node.kv_mgr = node.kv_mgr or self
            if "target" in bound:
                target = bound["target"]
                node.keep_ack_target(int(room), {(target.ip, target.port): target})
            else:
                node.keep_ack_target(int(room), (bound["decode_ip"], bound["decode_port"]))
        return original(self, room, *args, **kwargs)

    return register


def _available_less_stuck(original: Func) -> Func:
    """Prefill admission budgets free + evictable tokens. Source pages a transfer still pins after SGLang let go of
    them (:meth:`PrefillNode.stuck_tokens`) are evictable to SGLang, but evicting them frees nothing: without this
    the budget promises them, the allocation that follows fails, and SGLang's prefill scheduler dies ("Prefill out
    of memory"). The count may go below zero: when more is pinned than is free, the sum free + evictable must
    still come out right (SGLang's evict-then-allocate steps and its usage metric take the sum)."""

    def available_size(self: Any, *args: Any, **kwargs: Any) -> Any:
        available = original(self, *args, **kwargs)
        node = NODE
        if type(node) is PrefillNode and self is node.allocator and node.pins_released_pages():
            return available - node.stuck_tokens()
        return available

    return available_size


def _account_held_pages(original: Func) -> Func:
    """SGLang's idle leak check counts every page; pages we hold back are accounted, not leaked."""

    def check(pool_name: str, available: int, *args: Any, **kwargs: Any) -> Any:
        node = NODE
        if node is not None and pool_name == "full":
            available = available + node.held_tokens()
        return original(pool_name, available, *args, **kwargs)

    return check


# ---------------------------------------------------------------- failed writes and drain acks (prefill)


def _keep_poisoned_target(original: Func) -> Func:
    """0.5.23 "poisons" a room whose writes it cannot prove drained (a failed post, a handle that never settled)
    and drops its drain-ack target for good. The room becomes a failed write here (unsettled for the write
    lifetime) and a target already registered is kept, so the ack still goes out once the write cannot land."""

    def poison(self: Any, room: int, *args: Any, **kwargs: Any) -> Any:
        node = NODE
        if isinstance(node, PrefillNode):
            node.kv_mgr = node.kv_mgr or self
            if not node.write_failed(int(room)):
                node.note_failed_write([int(room)])
            targets = getattr(self, "_deferred_ack_targets", {}).get(room)
            if targets:
                node.keep_ack_target(int(room), targets)
        return original(self, room, *args, **kwargs)

    return poison


def _withhold_ack(original: Func) -> Func:
    """Prefill's drain ack for a room goes out only once the room settled (incl. a failed write's lifetime)."""
    signature = inspect.signature(original)

    def send_abort_ack(self: Any, *args: Any, **kwargs: Any) -> Any:
        node = NODE
        if not isinstance(node, PrefillNode):
            return original(self, *args, **kwargs)
        room = int(signature.bind(self, *args, **kwargs).arguments["room"])
        node.kv_mgr = node.kv_mgr or self
        if node.settled(room):
            return original(self, *args, **kwargs)
        decision = Decision(lifecycle.GUARD, Verdict.QUARANTINE, "drain ack withheld: a write of this room may "
                            "still land", None, {"room": room})
        if not events.record(decision, RUNTIME.config.lifecycle):
            return original(self, *args, **kwargs)
        node.stash_ack(room, lambda: original(self, *args, **kwargs))
        return None

    return send_abort_ack


# ---------------------------------------------------------------- the table (merged into sglang_v05.HOOKS)


HOOKS: list[Hook] = [
    Hook("lifecycle", SCHEDULER, "Scheduler.__init__", ("self", "server_args", "port_args"), _scheduler_init),
    *free_path_v05.HOOKS,
    Hook("lifecycle", ALLOC_TOKEN, "TokenToKVPoolAllocator.available_size", ("self",), _available_less_stuck),
    Hook("lifecycle", ALLOC_PAGED, "PagedTokenToKVPoolAllocator.available_size", ("self",), _available_less_stuck),
    Hook("lifecycle", *POP_TRANSFERRED, ("self",), _confirmations_first),
    Hook("lifecycle", *DECODE_DOOR, ("self", "req", "is_retracted"), _quarantine_door),
    Hook("lifecycle", *NOTE_ABORT_ACK, ("self", "bootstrap_room", "prefill_rank"),
         _note_ack),
    Hook("lifecycle", *SEND_ABORT_NOTICE, ("self",), _arm_drain_acks),
    Hook("lifecycle", CONN, "CommonKVManager._handle_node_failure", ("self", "failed_bootstrap_addr"),
         _note_gone),
    Hook("lifecycle", PREFILL, "SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue",
         ("self",), _settle_after_inflight),
    Hook("lifecycle", CONN, "CommonKVManager._send_abort_ack", ("self",), _withhold_ack),
    Hook("lifecycle", CONN, "CommonKVSender.clear", ("self",), _keep_ack_target),
    Hook("lifecycle", CONN, "CommonKVManager.register_deferred_ack_target", ("self", "room"), _capture_ack_target),
    Hook("lifecycle", INVARIANTS, "SchedulerInvariantChecker._check_pool_invariant",
         ("pool_name", "available", "evictable", "protected", "session_held", "total"), _account_held_pages),
    commit_chain.hook("lifecycle", "ledger", _finish_transfer),
    # Releases whose CommonKVManager "poisons" a room it cannot prove drained (and then never acks it) have this.
    Hook("lifecycle", CONN, "CommonKVManager.poison_deferred_ack_room", ("self", "room"), _keep_poisoned_target,
         optional=True),
]

# With the lifecycle guard off, the page-tag guard still needs decode's page ledger: these hooks keep it, armed under
# their own owner only then. Lifecycle's decisions stay off (mode off releases every freed page at once, changes no
# SGLang setting and makes no prefill node).
# Known by their wrappers, so a backend's receiver hook (it wraps ``_send_metadata``) is one without being listed.
LEDGER_WRAPPERS = (_scheduler_init, _send_metadata, *free_path_v05.LEDGER_WRAPPERS)


def ledger_hooks(lifecycle_hooks: list[Hook]) -> list[Hook]:
    """The page-tag guard's copies of the ledger-keeping lifecycle hooks (the backends' receivers included)."""
    copies = [replace(hook, owner=PAGE_LEDGER_OWNER) for hook in lifecycle_hooks
              if hook.owner == "lifecycle" and hook.make_wrapper in LEDGER_WRAPPERS]
    return [*copies, commit_chain.hook(PAGE_LEDGER_OWNER, "ledger", _finish_transfer)]


ROLES: dict[str, set[str]] = {"lifecycle": {"prefill", "decode"}, "page_tags": {"decode"},
                              PAGE_LEDGER_OWNER: {"decode"}}
