"""Test hook (test-only): corrupt one transfer on the real PD pair. Enabled by
``SGLANG_HARDEN_TESTBED_KV_FAULT=<kind>:<n>[,<kind>:<n>...]`` (both servers read it; each acts on its side).

Kinds:

* ``flip:<room>`` (decode): right before decode commits the finished transfer of that bootstrap room, one bit of
  one received KV row (layer 0 K, or MLA's latent row, of the request's middle token) is flipped: a corrupted transfer.
  ``flip@<rank>:<room>`` does it on that attention-TP rank of decode only (a mismatch one rank sees).
* ``unwritten:<pages>`` (prefill): a KV send of exactly ``<pages>`` pages leaves out its last page (source and
  destination alike), so the transfer reports success and decode's last reserved page keeps whatever it held
  before: a reserved page the transfer never wrote, the incident's stale page (one ``unwritten`` JSON line, where
  the trace folder is set: the pages the send had and the decode page left out).
* ``table:<room>`` (decode): right before decode commits that room's finished transfer, SGLang's own page table
  (``req_to_token``) is made inconsistent: the request's middle prompt page is pointed at a page in the KV
  allocator's free list (one whose rows still hold what an earlier request left, when there is one). The
  transfer wrote the right page; decode reads another. One JSON line (``table_fault``: rid, room, the page it
  had and the page it reads now) goes to ``$SGLANG_HARDEN_TESTBED_KVTRACE_DIR/kvfault-<pid>.jsonl``. The pool is
  not consistent afterwards (the request frees the free page again and never frees its own): use it last.

Vanilla decode generates over the result without noticing; the checksum and canary guards must abort the first
two, the page-tag guard the third.

"Right before decode commits" is the moment decode first learns that the transfer finished: at the start of the
transfer queue's ``pop_transferred`` pass in which the room's status (the manager's own ``check_status``, read
without polling through anyone's wrapper) is ``Success``. A fault room whose status is not yet ``Success`` answers
that status for the whole pass, so nobody (SGLang's commit, sglang-harden's commit gate) can see the transfer
finished before the fault is in place. Wraps ``DecodeTransferQueue.pop_transferred`` and the Mooncake/NIXL managers'
``send_kvcache`` (outside sglang-harden's own wrappers, keeping their marks).
"""

from __future__ import annotations

import functools
import os
import time
from types import ModuleType
from typing import Any

from sglang_harden_shimkit import append_trace_line, free_page_ids, kv_layer_buffers, pool_idx, wrap_methods_once

from sglang_harden._importhook import when_imported

ENV = "SGLANG_HARDEN_TESTBED_KV_FAULT"


def faults(kind: str) -> set[int]:
    """The numbers given for ``kind`` in the environment."""
    chosen: set[int] = set()
    for item in os.environ.get(ENV, "").split(","):
        if item.strip():
            name, number = item.split(":")
            if name.strip() == kind:
                chosen.add(int(number))
    return chosen


def _flip_one_bit(queue: Any, req: Any) -> None:
    import torch

    scheduler = queue.scheduler
    pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    token = len(req.origin_input_ids) // 2
    slot = int(scheduler.req_to_token_pool.req_to_token[int(pool_idx(req)), token])
    row = kv_layer_buffers(pool)[0][0][slot]
    raw = row.view(torch.uint8).reshape(-1)
    raw[0] ^= 1
    append_trace_line("kvfault", {"event": "flip", "rid": req.rid, "room": int(req.bootstrap_room), "slot": slot})


def _stale_free_page(scheduler: Any, page_size: int) -> int:
    """A page id from the allocator's free list whose first row is not all zero (an earlier request's KV), else
    the first free page."""
    allocator = scheduler.token_to_kv_pool_allocator
    free = free_page_ids(allocator)  # recently released first: the likeliest to hold an earlier request's rows
    if not free:
        raise RuntimeError("kvfault table: the KV allocator has no free page to point at")
    k0 = kv_layer_buffers(allocator.get_kvcache())[0][0]
    for page in free:
        if bool(k0[page * page_size].abs().sum() > 0):
            return page
    return free[0]


def _repoint_one_page(queue: Any, req: Any) -> None:
    scheduler = queue.scheduler
    page_size = int(getattr(scheduler, "page_size", None) or 1)
    table = scheduler.req_to_token_pool.req_to_token
    idx = int(pool_idx(req))
    middle = len(req.origin_input_ids) // 2
    first = (middle // page_size) * page_size
    last = min(first + page_size, len(req.origin_input_ids))
    old_page = int(table[idx, first]) // page_size
    new_page = _stale_free_page(scheduler, page_size)
    for pos in range(first, last):
        table[idx, pos] = new_page * page_size + pos % page_size
    append_trace_line("kvfault", {"event": "table_fault", "rid": req.rid, "room": int(req.bootstrap_room),
                                  "page_was": old_page, "page_now": new_page, "positions": [first, last],
                                  "t": time.time()})


def _decode_rank(queue: Any) -> int:
    from sglang_harden.compat.kv_digest import _tp_coordinates

    return (_tp_coordinates(queue.scheduler) or (0, 1))[0]


def _flip_rooms(queue: Any) -> set[int]:
    return faults("flip") | faults(f"flip@{_decode_rank(queue)}")


def _fault_before_commit(queue: Any, req: Any) -> None:
    room = getattr(req, "bootstrap_room", None)
    if room is not None and int(room) in _flip_rooms(queue):
        _flip_one_bit(queue, req)
    if room is not None and int(room) in faults("table"):
        _repoint_one_page(queue, req)


_FAULTED: set[int] = set()  # rooms faulted already (each once)


def _raw_status(receiver: Any) -> Any:
    """The room's transfer status as the manager holds it (0.5.x), past every wrapper of the receiver's poll;
    0.4.x receivers have no such read: their poll is asked."""
    check = getattr(getattr(receiver, "kv_mgr", None), "check_status", None)
    return check(receiver.bootstrap_room) if check is not None else receiver.poll()


def _wrap_pop_transferred(original: Any) -> Any:
    """A fault room's status is read once before the pass; it answers that for the whole pass, and when it is
    ``Success`` the fault is made first, so the pass (and the commit 0.4.x makes inside it) sees the faulted KV."""
    from sglang.srt.disaggregation.base import KVPoll

    @functools.wraps(original)
    def pop_transferred(self: Any, *args: Any, **kwargs: Any) -> Any:
        rooms = (_flip_rooms(self) | faults("table")) - _FAULTED
        held = []
        for decode_req in list(self.queue):
            room = getattr(decode_req.req, "bootstrap_room", None)
            if room is None or int(room) not in rooms:
                continue
            receiver = decode_req.kv_receiver
            answer = _raw_status(receiver)
            if int(answer) == int(KVPoll.Success):
                _fault_before_commit(self, decode_req.req)
                _FAULTED.add(int(room))
                continue
            receiver.poll = lambda answer=answer: answer  # an instance attribute: shadows the method
            held.append(receiver)
        try:
            return original(self, *args, **kwargs)
        finally:
            for receiver in held:
                del receiver.poll

    return pop_transferred


def _wrap_send_kvcache(original: Any) -> Any:
    sizes = faults("unwritten")

    @functools.wraps(original)
    def send_kvcache(self: Any, peer: Any, prefill_kv_indices: Any, dst_kv_ptrs: Any, dst_kv_indices: Any,
                     *args: Any, **kwargs: Any) -> Any:
        if len(prefill_kv_indices) in sizes and len(dst_kv_indices) == len(prefill_kv_indices):
            append_trace_line("kvfault", {"event": "unwritten", "pages": len(dst_kv_indices),
                                          "decode_page_left_out": int(dst_kv_indices[-1])})
            prefill_kv_indices, dst_kv_indices = prefill_kv_indices[:-1], dst_kv_indices[:-1]
        return original(self, peer, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, *args, **kwargs)

    return send_kvcache


def _patch_decode(module: ModuleType) -> None:
    wrap_methods_once(module.DecodeTransferQueue, "_sglang_harden_kvfault", {"pop_transferred": _wrap_pop_transferred})


def _patch_manager(class_name: str) -> Any:
    def patch(module: ModuleType) -> None:
        cls = getattr(module, class_name, None)
        if cls is not None:
            wrap_methods_once(cls, "_sglang_harden_kvfault", {"send_kvcache": _wrap_send_kvcache})

    return patch


def install() -> None:
    when_imported("sglang.srt.disaggregation.decode", _patch_decode)
    when_imported("sglang.srt.disaggregation.mooncake.conn", _patch_manager("MooncakeKVManager"))
    when_imported("sglang.srt.disaggregation.nixl.conn", _patch_manager("NixlKVManager"))
