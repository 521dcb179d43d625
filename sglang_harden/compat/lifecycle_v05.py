"""Page lifecycle and page ownership tags on SGLang 0.5.19 … 0.5.23 (Mooncake and NIXL transfer backends).

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
  * ``CommonKVManager.note_abort_ack`` (prefill's drain acknowledgement) and ``_handle_node_failure``
    (the sender is gone): the only ways out of quarantine, applied on the scheduler thread at the next
    ``pop_transferred``;
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
``send_kvcache`` is split here; NIXL transfers are not windowed). Any other backend (e.g. MORI) refuses to
start while the lifecycle guard is on. All decisions come from ``guards.lifecycle`` and ``guards.page_tags``.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from sglang_harden import events
from sglang_harden.compat.abort_v05 import abort_and_stream
from sglang_harden.compat.hooks import Hook
from sglang_harden.compat.lifecycle_nodes import (
    PUBLISHED,
    DecodeNode,
    PrefillNode,
    Transfer,
    _kv_poll,
)
from sglang_harden.compat.runtime import RUNTIME
from sglang_harden.compat.shared import role_of
from sglang_harden.config import Mode
from sglang_harden.guards import lifecycle, page_tags
from sglang_harden.guards.base import Decision, Verdict, allow

logger = logging.getLogger("sglang_harden")

Func = Callable[..., Any]

DECODE = "sglang.srt.disaggregation.decode"
PREFILL = "sglang.srt.disaggregation.prefill"
CONN = "sglang.srt.disaggregation.common.conn"
MOONCAKE = "sglang.srt.disaggregation.mooncake.conn"
NIXL = "sglang.srt.disaggregation.nixl.conn"
# Transfer backends whose receiver/manager the ledger is fed from; any other backend refuses to start.
BACKEND_MODULES = {"mooncake": MOONCAKE, "nixl": NIXL}
SCHEDULER = "sglang.srt.managers.scheduler"
ALLOC_TOKEN = "sglang.srt.mem_cache.allocator.token"
ALLOC_PAGED = "sglang.srt.mem_cache.allocator.paged"
INVARIANTS = "sglang.srt.managers.scheduler_components.invariant_checker"

DEFERRED_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE"
WINDOW_ENV = "SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES"
# the ALLOW decisions of a transfer's hot path, made once (the hooks' log lines carry the room / rid)
TAGS_OK = allow(page_tags.GUARD)
PUBLISHED_TALLY = events.Tally(PUBLISHED)
ADMITTED_TALLY = events.Tally(allow(lifecycle.GUARD))  # the quarantine door let a new request in
TAGS_OK_TALLY = events.Tally(TAGS_OK)


NODE: DecodeNode | PrefillNode | None = None


def node_report() -> dict[str, Any] | None:
    return NODE.report() if NODE is not None else None


# ---------------------------------------------------------------- allocator hooks (both roles)


def _pages_of(free_index: Any, page_size: int) -> np.ndarray:
    try:
        raw = free_index.numpy()  # index tensors never require grad; a CUDA tensor raises here
    except (TypeError, RuntimeError):
        raw = free_index.detach().cpu().numpy()
    arr = raw.astype(np.int64, copy=False)
    return arr // page_size if page_size > 1 else arr


def _filter(node: DecodeNode | PrefillNode, pages: np.ndarray) -> np.ndarray | None:
    mode = RUNTIME.config.lifecycle
    return node.keep_back(pages, mode)


def _token_free(original: Func) -> Func:
    def free(self: Any, free_index: Any) -> Any:
        node = NODE
        if node is None or self is not node.allocator or free_index.numel() == 0:
            return original(self, free_index)
        if isinstance(node, DecodeNode) and node.released_in_place(free_index):
            return original(self, free_index)
        keep = _filter(node, _pages_of(free_index, 1))
        if keep is None:
            return original(self, free_index)
        import torch

        passed = free_index[torch.from_numpy(~keep).to(free_index.device)]
        return original(self, passed)

    return free


def _paged_release(original: Func) -> Func:
    def release_page_ids(self: Any, *page_ids: Any) -> Any:
        node = NODE
        if node is None or self is not node.allocator:
            return original(self, *page_ids)
        import torch

        passed = []
        for ids in page_ids:
            keep = _filter(node, _pages_of(ids, 1)) if ids.numel() else None
            passed.append(ids if keep is None else ids[torch.from_numpy(~keep).to(ids.device)])
        return original(self, *passed)

    return release_page_ids


def _free_now(node: DecodeNode | PrefillNode, pages: list[int]) -> None:
    if not pages:
        return
    import torch

    allocator = node.allocator
    index = torch.tensor(pages, dtype=torch.int64, device=allocator.device)
    if node.page_size == 1:
        allocator.free(index)
    else:
        allocator._release_page_ids(index)


# ---------------------------------------------------------------- start-up (both roles)


def _scheduler_init(original: Func) -> Func:
    def init(self: Any, server_args: Any, port_args: Any, *args: Any, **kwargs: Any) -> Any:
        _process_env(str(getattr(server_args, "disaggregation_mode", "null")))
        result = original(self, server_args, port_args, *args, **kwargs)
        _make_node(self)
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


def _make_node(scheduler: Any) -> None:
    global NODE

    role = role_of(scheduler)
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


TRANSFER_ATTR = "_sglang_harden_transfer"


def _commit_finishes_transfer(original: Func) -> Func:
    """The ledger learns the transfer finished (its pages written) before SGLang commits the request."""

    def commit(self: Any, decode_req: Any) -> Any:
        node = NODE
        room = getattr(decode_req.req, "bootstrap_room", None)
        transfer = node.finish(int(room)) if isinstance(node, DecodeNode) and room is not None else None
        setattr(decode_req, TRANSFER_ATTR, transfer)
        return original(self, decode_req)

    return commit


def _commit_with_tags(original: Func) -> Func:
    """After the commit (the lifecycle wrapper inside has finished the transfer), check the page table."""

    def commit(self: Any, decode_req: Any) -> Any:
        node = NODE
        req = decode_req.req
        result = original(self, decode_req)
        transfer = getattr(decode_req, TRANSFER_ATTR, None)
        if transfer is None or _aborted(req):
            return result
        refused = verify_page_tags(node, self.scheduler, req, transfer)  # type: ignore[arg-type]
        if refused is not None:
            from sglang.srt.disaggregation.utils import prepare_abort

            prepare_abort(req, "sglang-harden page ownership check failed: " + refused.reason,
                          status_code=refused.status_code or 500)
        return result

    return commit


def verify_page_tags(node: DecodeNode, scheduler: Any, req: Any, transfer: Transfer) -> Decision | None:
    """Check and count the page tags of a committed request; the decision when it must be aborted."""
    decision = check_request_pages(node, scheduler, req, transfer)
    mode = RUNTIME.config.page_tags
    if decision is TAGS_OK:
        TAGS_OK_TALLY.bump(mode, room=transfer.room, rid=req.rid)
        return None
    return decision if events.record(decision, mode, room=transfer.room, rid=req.rid) else None


def check_request_pages(node: DecodeNode, scheduler: Any, req: Any, transfer: Transfer) -> Decision:
    """Page tags over the request's page table (prompt rows), its own cached prefix allowed."""
    pool_idx = _pool_idx(req)
    length = len(req.origin_input_ids)
    if pool_idx is None or length <= 0:
        return allow(page_tags.GUARD, rid=str(req.rid), pages=0)
    table = scheduler.req_to_token_pool.req_to_token
    prefix = getattr(req, "prefix_indices", None)
    prefix_pages: list[int] = []
    if prefix is not None and len(prefix) > 0:
        prefix_pages = lifecycle.distinct(_pages_of(prefix, node.page_size)).tolist()
    else:  # a page repeats per token in the table: fine here
        view = node.table_view
        if view is not None and view[0] is table:  # a CPU table: read in place
            owned = node.ledger.row_owned_written(transfer.owner, transfer.generation, view[1], pool_idx, length,
                                                  node.page_size)
        else:
            owned = node.ledger.all_owned_written(transfer.owner, transfer.generation,
                                                  _page_table_rows(node, table, pool_idx, length), node.page_size)
        if owned:
            return TAGS_OK
    rows = _page_table_rows(node, table, pool_idx, length).astype(np.int64)
    pages = rows // node.page_size if node.page_size > 1 else rows
    return page_tags.check_page_table(node.ledger, transfer.owner, transfer.generation,
                                      lifecycle.distinct(pages).tolist(), prefix_pages)


def _page_table_rows(node: DecodeNode, table: Any, pool_idx: int, length: int) -> np.ndarray:
    """``table[pool_idx, :length]`` as int numpy (the table's dtype); a CPU page table is read through a numpy
    view made once."""
    view = node.table_view
    if view is None or view[0] is not table:
        try:
            node.table_view = view = (table, table.numpy())
        except (TypeError, RuntimeError):  # a CUDA page table: read the row through torch
            return _pages_of(table[pool_idx, :length], 1)
    return view[1][pool_idx, :length]


def _pool_idx(req: Any) -> int | None:
    kv = getattr(req, "kv", None)
    idx = getattr(kv, "req_pool_idx", None) if kv is not None else None
    return idx if idx is not None else getattr(req, "req_pool_idx", None)


def _aborted(req: Any) -> bool:
    reason = getattr(req, "finished_reason", None)
    return reason is not None and type(reason).__name__ == "FINISH_ABORT"


def _confirmations_first(original: Func) -> Func:
    def pop_transferred(self: Any, *args: Any, **kwargs: Any) -> Any:
        node = NODE
        if isinstance(node, DecodeNode) and node.ledger.quarantined_count():
            _free_now(node, node.confirmations())
        return original(self, *args, **kwargs)

    return pop_transferred


def _note_ack(original: Func) -> Func:
    def note_abort_ack(self: Any, bootstrap_room: int, prefill_rank: int, *args: Any, **kwargs: Any) -> Any:
        node = NODE
        if isinstance(node, DecodeNode):
            node.note_ack(bootstrap_room, prefill_rank)
        return original(self, bootstrap_room, prefill_rank, *args, **kwargs)

    return note_abort_ack


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
    def add_transfer_request(self: Any, bootstrap_room: int, kv_indices: Any, *args: Any, **kwargs: Any) -> Any:
        node = NODE
        if isinstance(node, PrefillNode) and _will_enqueue(self, bootstrap_room):
            node.hold(self, int(bootstrap_room), np.array(kv_indices, dtype=np.int64))  # the node's own copy
        return original(self, bootstrap_room, kv_indices, *args, **kwargs)

    return add_transfer_request


def chunks_queued(room: int) -> bool:
    """Whether a KV chunk of ``room`` was handed to this prefill's transfer engine (and its sources not yet
    let go). Without a prefill node (lifecycle off) nobody knows: True."""
    node = NODE
    if not isinstance(node, PrefillNode):
        return True
    return room in node.holds or room in node.pending or room in node.failed_writes


def _will_enqueue(mgr: Any, room: int) -> bool:
    status = mgr.request_status.get(room)
    return status is not None and status != _kv_poll().failed and room in mgr.transfer_infos


def _settle_after_inflight(original: Func) -> Func:
    def process(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        node = NODE
        if isinstance(node, PrefillNode) and node.busy():
            _free_now(node, node.settle_pending())
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
                node.orphan_targets[int(room)] = target
        return original(self, *args, **kwargs)

    return clear


def _capture_ack_target(original: Func) -> Func:
    """0.5.23 "poisons" a room whose engine call failed (the batch may still be writing) and then never acks
    it, so decode's only exit is its release timeout. Keep the target; after the write lifetime we ack."""
    signature = inspect.signature(original)

    def register(self: Any, room: int, *args: Any, **kwargs: Any) -> Any:
        node = NODE
        if isinstance(node, PrefillNode) and int(room) in node.failed_writes:
            bound = signature.bind(self, room, *args, **kwargs).arguments
            node.kv_mgr = node.kv_mgr or self
            if "target" in bound:
                target = bound["target"]
                _keep_ack_targets(node, int(room), {(target.ip, target.port): target})
            else:
                node.orphan_targets[int(room)] = (bound["decode_ip"], bound["decode_port"])
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


# ---------------------------------------------------------------- bounded transfer window (pins without the env)


def _send_kvcache(original: Func) -> Func:
    """Bounded transfer window (pins without the env) and failed-write tracking (every pin)."""

    def send_kvcache(self: Any, mooncake_session_id: str, prefill_kv_indices: Any, dst_kv_ptrs: Any,
                     dst_kv_indices: Any, executor: Any, *args: Any, **kwargs: Any) -> Any:
        status = _send_windows(original, self, mooncake_session_id, prefill_kv_indices, dst_kv_ptrs,
                               dst_kv_indices, executor, *args, **kwargs)
        node = NODE
        if status != 0 and isinstance(node, PrefillNode):
            node.note_failed_write(_rooms_in_flight(self, mooncake_session_id))
        return status

    return send_kvcache


def _send_windows(original: Func, mgr: Any, session: str, src: Any, ptrs: Any, dst: Any, executor: Any,
                  *args: Any, **kwargs: Any) -> Any:
    window = RUNTIME.config.transfer_window_pages
    if window <= 0 or hasattr(mgr, "max_transfer_batch_indices") or len(src) <= window:
        return original(mgr, session, src, ptrs, dst, executor, *args, **kwargs)
    for start in range(0, len(src), window):
        end = start + window
        status = original(mgr, session, src[start:end], ptrs, dst[start:end], executor, *args, **kwargs)
        if status != 0:
            return status
    return 0


def _nixl_send_kvcache(original: Func) -> Func:
    """NIXL raises when the post of a KV transfer fails; the request may have been posted in part, so its bytes
    may still land in decode's pages (0.5.23 says so itself and poisons the room's drain ack, but NIXL rooms were
    never marked as failed writes here, so decode's quarantine had no way out)."""

    def send_kvcache(self: Any, peer_name: str, prefill_kv_indices: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, peer_name, prefill_kv_indices, *args, **kwargs)
        except Exception:
            node = NODE
            if isinstance(node, PrefillNode):
                node.kv_mgr = node.kv_mgr or self
                node.note_failed_write(_rooms_in_flight(self, peer_name))
            raise

    return send_kvcache


def _failure_with_drain_evidence(original: Func) -> Func:
    """0.5.19's transfer worker fails every room queued for a decode session it has just marked failed, without
    writing anything of them. Decode cannot tell those rooms from the one whose write failed, so it quarantined
    all of them until a drain ack came back (a dozen rooms at once on a busy node). The worker that fails a room
    with no write of it in flight now sends the drain ack first, on the same socket as the failure, so decode
    frees the pages at once; a room whose write failed gets no ack here (its ack waits for the write lifetime)."""

    def sync_status(self: Any, remote: str, dst_port: int, room: int, status: int, *args: Any, **kwargs: Any) -> Any:
        node = NODE
        if (isinstance(node, PrefillNode) and status == _kv_poll().failed and not getattr(self, "enable_staging", False)
                and node.failed_without_write_in_flight(int(room))):
            _send_drain_evidence(self, remote, dst_port, int(room))
        return original(self, remote, dst_port, room, status, *args, **kwargs)

    return sync_status


def _send_drain_evidence(mgr: Any, decode_ip: str, decode_port: int, room: int) -> None:
    """SGLang's own drain ack, past :func:`_withhold_ack` (which waits for the worker's chunk to be counted
    done: the worker sending this is that chunk, and it wrote nothing)."""
    send_ack = inspect.unwrap(type(mgr)._send_abort_ack)
    try:
        send_ack(mgr, decode_ip, decode_port, room)
    except Exception as exc:  # noqa: BLE001 - decode then quarantines the pages and asks for the ack itself
        logger.warning("sglang-harden lifecycle: drain ack with the failure of room %s not sent: %r", room, exc)
        return
    events.record(Decision(lifecycle.GUARD, Verdict.RELEASE, "room failed with no write of it in flight: drain "
                           "ack sent with the failure", None, {"room": room}), Mode.ENFORCE)


def _keep_poisoned_target(original: Func) -> Func:
    """0.5.23 "poisons" a room whose writes it cannot prove drained (a failed post, a handle that never settled)
    and drops its drain-ack target for good. The room becomes a failed write here (unsettled for the write
    lifetime) and a target already registered is kept, so the ack still goes out once the write cannot land."""

    def poison(self: Any, room: int, *args: Any, **kwargs: Any) -> Any:
        node = NODE
        if isinstance(node, PrefillNode):
            node.kv_mgr = node.kv_mgr or self
            if int(room) not in node.failed_writes:
                node.note_failed_write([int(room)])
            targets = getattr(self, "_deferred_ack_targets", {}).get(room)
            if targets:
                _keep_ack_targets(node, int(room), targets)
        return original(self, room, *args, **kwargs)

    return poison


def _keep_ack_targets(node: PrefillNode, room: int, targets: dict[Any, Any]) -> None:
    """Add ``targets`` (``{(ip, port): target}``) to the room's kept drain-ack targets."""
    merged = dict(node.orphan_targets.get(room) or {})
    merged.update(targets)
    node.orphan_targets[room] = merged


def _rooms_in_flight(mgr: Any, session: str) -> list[int]:
    """Rooms of ``session`` with a chunk dequeued by a transfer worker right now (the one whose write failed).
    ``session``: Mooncake's session id or NIXL's peer agent name (both key a room's ``transfer_infos``)."""
    outstanding = getattr(mgr, "_staging_outstanding", {})
    return [room for room, infos in list(mgr.transfer_infos.items())
            if session in infos and outstanding.get(room, 0) > 0]


# Pins (per backend) whose prefill answers a decode abort notice for a room that already concluded (Success, or
# cleared) with a drain ack only when no chunk of the room is counted in flight, and otherwise with nothing: no ack
# then, and no target kept for the worker to ack later, so decode's quarantine of the room never ends. Later pins
# keep the target whenever a chunk is still counted.
DROPS_ACK_OF_CONCLUDED_ROOM: dict[str, tuple[str, ...]] = {"mooncake": ("0.5.19", "0.5.20"),
                                                            "nixl": ("0.5.19", "0.5.20", "0.5.21")}
ABORT_TAG = b"ABORT"


def _note_abort_notice(mgr: Any, backend: str, msg: Sequence[bytes]) -> None:
    """Keep the drain-ack target of an abort notice SGLang is about to drop (see DROPS_ACK_OF_CONCLUDED_ROOM); the
    ack goes out once the room settled (:meth:`PrefillNode.settle_pending`)."""
    node = NODE
    if not isinstance(node, PrefillNode) or RUNTIME.pin not in DROPS_ACK_OF_CONCLUDED_ROOM.get(backend, ()):
        return
    notice = _abort_notice(msg)
    if notice is None or not getattr(mgr, "enable_deferred_decode_kv_release", False):
        return
    room, decode_ip, decode_port = notice
    concluded = room not in mgr.request_status or mgr.check_status(room) == _kv_poll().success
    if concluded and mgr._staging_outstanding.get(room, 0) > 0:
        node.kv_mgr = node.kv_mgr or mgr
        node.orphan_targets[room] = (decode_ip, decode_port)


def _abort_notice(msg: Sequence[bytes]) -> tuple[int, str, int] | None:
    """(room, decode ip, decode port) of a decode abort notice carrying its ack target; None for anything else."""
    if len(msg) < 4 or msg[0] != ABORT_TAG:
        return None
    try:
        return int(msg[1].decode("ascii")), msg[2].decode("ascii"), int(msg[3].decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        return None  # SGLang logs and drops a malformed notice itself


def _nixl_abort_notice(original: Func) -> Func:
    def handle_abort_notification(self: Any, msg: Any, *args: Any, **kwargs: Any) -> Any:
        _note_abort_notice(self, "nixl", msg)
        return original(self, msg, *args, **kwargs)

    return handle_abort_notification


class _NoticeWatchingSocket:
    """Mooncake's prefill bootstrap socket, as its listener thread reads it (on the pins listed in
    DROPS_ACK_OF_CONCLUDED_ROOM the thread handles abort notices inline, with no method to hook)."""

    def __init__(self, socket: Any, mgr: Any):
        self._socket, self._mgr = socket, mgr

    def recv_multipart(self, *args: Any, **kwargs: Any) -> Any:
        msg = self._socket.recv_multipart(*args, **kwargs)
        _note_abort_notice(self._mgr, "mooncake", msg)
        return msg

    def __getattr__(self, name: str) -> Any:
        return getattr(self._socket, name)


def _mooncake_abort_notices(original: Func) -> Func:
    def start_prefill_thread(self: Any, *args: Any, **kwargs: Any) -> Any:
        if RUNTIME.pin in DROPS_ACK_OF_CONCLUDED_ROOM["mooncake"] and not isinstance(self.server_socket,
                                                                                     _NoticeWatchingSocket):
            self.server_socket = _NoticeWatchingSocket(self.server_socket, self)
        return original(self, *args, **kwargs)

    return start_prefill_thread


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
        node.stashed_acks.setdefault(room, []).append(lambda: original(self, *args, **kwargs))
        return None

    return send_abort_ack


# ---------------------------------------------------------------- the table (merged into sglang_v05.HOOKS)


HOOKS: list[Hook] = [
    Hook("lifecycle", SCHEDULER, "Scheduler.__init__", ("self", "server_args", "port_args"), _scheduler_init),
    Hook("lifecycle", ALLOC_TOKEN, "TokenToKVPoolAllocator.free", ("self", "free_index"), _token_free),
    Hook("lifecycle", ALLOC_PAGED, "PagedTokenToKVPoolAllocator._release_page_ids", ("self",), _paged_release),
    Hook("lifecycle", ALLOC_TOKEN, "TokenToKVPoolAllocator.available_size", ("self",), _available_less_stuck),
    Hook("lifecycle", ALLOC_PAGED, "PagedTokenToKVPoolAllocator.available_size", ("self",), _available_less_stuck),
    Hook("lifecycle", MOONCAKE, "MooncakeKVReceiver.send_metadata", ("self", "kv_indices"), _send_metadata),
    Hook("lifecycle", NIXL, "NixlKVReceiver.send_metadata", ("self", "kv_indices"), _send_metadata),
    Hook("lifecycle", DECODE, "DecodeTransferQueue.pop_transferred", ("self",), _confirmations_first),
    Hook("lifecycle", DECODE, "DecodePreallocQueue.add", ("self", "req", "is_retracted"), _quarantine_door),
    Hook("lifecycle", CONN, "CommonKVManager.note_abort_ack", ("self", "bootstrap_room", "prefill_rank"),
         _note_ack),
    Hook("lifecycle", CONN, "CommonKVManager._handle_node_failure", ("self", "failed_bootstrap_addr"),
         _note_gone),
    Hook("lifecycle", MOONCAKE, "MooncakeKVManager.add_transfer_request", ("self", "bootstrap_room", "kv_indices"),
         _hold_sources),
    Hook("lifecycle", NIXL, "NixlKVManager.add_transfer_request", ("self", "bootstrap_room", "kv_indices"),
         _hold_sources),
    Hook("lifecycle", PREFILL, "SchedulerDisaggregationPrefillMixin.process_disagg_prefill_inflight_queue",
         ("self",), _settle_after_inflight),
    Hook("lifecycle", MOONCAKE, "MooncakeKVManager.send_kvcache",
         ("self", "mooncake_session_id", "prefill_kv_indices", "dst_kv_ptrs", "dst_kv_indices", "executor"),
         _send_kvcache),
    Hook("lifecycle", NIXL, "NixlKVManager.send_kvcache", ("self", "peer_name", "prefill_kv_indices"),
         _nixl_send_kvcache),
    Hook("lifecycle", CONN, "CommonKVManager._send_abort_ack", ("self",), _withhold_ack),
    Hook("lifecycle", MOONCAKE, "MooncakeKVManager.start_prefill_thread", ("self",), _mooncake_abort_notices),
    Hook("lifecycle", NIXL, "NixlKVManager._handle_abort_notification", ("self", "msg"), _nixl_abort_notice),
    Hook("lifecycle", CONN, "CommonKVSender.clear", ("self",), _keep_ack_target),
    Hook("lifecycle", CONN, "CommonKVManager.register_deferred_ack_target", ("self", "room"), _capture_ack_target),
    Hook("lifecycle", INVARIANTS, "SchedulerInvariantChecker._check_pool_invariant",
         ("pool_name", "available", "evictable", "protected", "session_held", "total"), _account_held_pages),
    Hook("lifecycle", DECODE, "DecodeTransferQueue._commit_transfer_to_req", ("self", "decode_req"),
         _commit_finishes_transfer),
    Hook("page_tags", DECODE, "DecodeTransferQueue._commit_transfer_to_req", ("self", "decode_req"),
         _commit_with_tags),
]

# Pins whose CommonKVManager "poisons" a room it cannot prove drained (and then never acks it).
POISONS_UNDRAINED_ROOMS = ("0.5.22", "0.5.23")


POISON_HOOKS = [Hook("lifecycle", CONN, "CommonKVManager.poison_deferred_ack_room", ("self", "room"),
                     _keep_poisoned_target)]


# Pins whose Mooncake transfer worker tells decode of a room's status itself, one endpoint at a time (later pins
# conclude a room through CommonKVManager).
SYNCS_STATUS_PER_ENDPOINT = ("0.5.19",)

EVIDENCE_HOOKS = [Hook("lifecycle", MOONCAKE, "MooncakeKVManager.sync_status_to_decode_endpoint",
                       ("self", "remote", "dst_port", "room", "status"), _failure_with_drain_evidence)]


def pin_hooks() -> list[Hook]:
    """Hooks only some pins of the family have targets for (merged into sglang_v05.HOOKS)."""
    return ((POISON_HOOKS if RUNTIME.pin in POISONS_UNDRAINED_ROOMS else [])
            + (EVIDENCE_HOOKS if RUNTIME.pin in SYNCS_STATUS_PER_ENDPOINT else []))


ROLES: dict[str, set[str]] = {"lifecycle": {"prefill", "decode"}, "page_tags": {"decode"}}


def needed_on_backend(hook: Hook, backend: str) -> bool:
    """A hook into one transfer backend's module is needed only in processes that use that backend."""
    return hook.module not in BACKEND_MODULES.values() or hook.module == BACKEND_MODULES.get(backend)


def check_backend(role: str, backend: str) -> str | None:
    """Why the lifecycle guards cannot run on ``backend`` (None: they can)."""
    if role not in ("prefill", "decode") or RUNTIME.config.lifecycle is Mode.OFF or backend in BACKEND_MODULES:
        return None
    return (f"sglang-harden page lifecycle supports the {'/'.join(BACKEND_MODULES)} transfer backends, not "
            f"{backend!r}; use one of those or start with --harden-lifecycle off (the page ledger then does not "
            "guard against late writes)")
