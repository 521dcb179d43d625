"""White-box KV tracer for the incident tests (test-only; enabled by SGLANG_HARDEN_TESTBED_KVTRACE_DIR).

Runs inside the decode server's scheduler process. Two events, written as JSON lines to
``$SGLANG_HARDEN_TESTBED_KVTRACE_DIR/kvtrace-<pid>.jsonl``:

- ``release``: when a request finishes, the KV rows of its slots are fingerprinted (slot -> rid, hash of each
  layer's K and V part of the row).
- ``first_decode``: right before a request's first decode forward, each of its context slots is hashed and
  compared with the recorded fingerprints: a slot whose content is byte-identical to what another request
  left there was never overwritten by this request's own transfer, so the decode step reads that other
  request's KV ("pages of A read by B"). A row where only some parts (a layer, K or V) still hold the other
  request's bytes is a foreign read as well (``partial_rows``: a transfer that wrote part of the row).
  ``pages`` lists the KV pages its context occupies.

Owners are recorded for every request that ever held a slot, not only for those that finish: decode's
preallocation (``DecodePreallocQueue._pre_alloc``) names the holder of each slot, and every free of the
allocator (``free``, and on a paged allocator the page-level ``_release_page_ids`` that SGLang's segment frees
reach without ``free``) fingerprints the freed slots under that holder (a request aborted in a queue, disconnected,
retracted or refused after its pages were allocated). The writer is kept per part: a part whose bytes did not
change since the record before keeps that record's writer (a holder aborted before its transfer wrote, a stub that
never got its prompt's KV, left another request's bytes, not its own), so a reader with the true writer's prefix
(the same KV) is not charged. ``foreign_from_unfinished`` counts the foreign rows whose writer never finished (the
tracer saw those only through the free).

A third look closes the gap between the two: when decode commits a request's finished transfer
(``DecodeTransferQueue._commit_transfer_to_req``) its context rows are hashed, and ``first_decode`` reports
``rows_changed_since_commit``: rows something wrote after the transfer was done and before the request read them
(a late write landing there).

Hooks ``Scheduler.run_batch``, ``Scheduler.process_batch_result`` and, on 0.5.x decode,
``DecodeTransferQueue._commit_transfer_to_req``.
"""

from __future__ import annotations

import functools
import hashlib
import threading
import time
from collections import Counter
from types import ModuleType
from typing import Any

from sglang_harden_shimkit import append_trace_line, kv_layer_buffers, pool_idx, wrap_methods_once

from sglang_harden._importhook import when_imported

_lock = threading.Lock()
RowHash = tuple[str, ...]  # one hash per K/V part of each layer
# who wrote a part's bytes: (rid, key of its token ids up to that row, how it was recorded: "finished" at its release,
# "freed" when its pages were freed without a release)
Writer = tuple[str, int, str]
# slot -> (the row's part hashes at the last record, the writer of each part): a part whose bytes did not change
# since the record before keeps that record's writer (a holder whose transfer never wrote there left another's bytes)
_owners: dict[int, tuple[RowHash, tuple[Writer, ...]]] = {}
_holders: dict[int, tuple[str, int]] = {}  # slot -> (rid, key) of the request decode preallocated it for
_seen_decode: set[str] = set()
_context_at_first_decode: dict[str, tuple[list[int], list[RowHash]]] = {}  # rid -> (context slots, row hashes)
_context_at_commit: dict[str, tuple[list[int], list[RowHash]]] = {}  # rid -> (context slots, row hashes)


def _emit(record: dict[str, Any]) -> None:
    record["t"] = time.time()
    with _lock:
        append_trace_line("kvtrace", record)


def _is_decode(scheduler: Any) -> bool:
    mode = getattr(scheduler, "disaggregation_mode", None)
    return "decode" in str(getattr(mode, "value", mode)).lower()


def _kv_buffers(scheduler: Any) -> tuple[list[Any], list[Any]]:
    return kv_layer_buffers(scheduler.token_to_kv_pool_allocator.get_kvcache())


def _slots(scheduler: Any, req: Any, length: int) -> list[int]:
    idx = pool_idx(req)
    if idx is None or length <= 0:
        return []
    return [int(s) for s in scheduler.req_to_token_pool.req_to_token[idx, :length].tolist()]


def _row_hashes(scheduler: Any, slots: list[int]) -> list[RowHash]:
    """Per slot, one hash per part of its KV row (each layer's K, then each layer's V)."""
    import torch

    if not slots:
        return []
    k_bufs, v_bufs = _kv_buffers(scheduler)
    index = torch.tensor(slots, dtype=torch.long, device=k_bufs[0].device)
    parts = [buf.index_select(0, index).reshape(len(slots), -1).contiguous().cpu().view(torch.uint8).numpy()
             for buf in (*k_bufs, *v_bufs)]
    return [tuple(hashlib.blake2b(part[i].tobytes(), digest_size=8).hexdigest() for part in parts)
            for i in range(len(slots))]


def _deep_parts(row: RowHash) -> list[int]:
    """The parts of layers past the first. The first layer's K and V depend only on the token (and its position), not
    on the prefix, so another request with the same token there writes the same bytes: those parts prove nothing."""
    layers = len(row) // 2
    return [i for i in range(len(row)) if i % layers != 0]


def foreign_parts(owner: tuple[RowHash, tuple[Writer, ...]], now: RowHash, rid: str, key: int
                  ) -> tuple[Writer, bool] | None:
    """Whether a reader (``rid``, prefix ``key``) reads another request's bytes in this row: some deep part still holds
    what a different request with a different prefix wrote. ``(that writer, whether the whole row is unchanged since
    the record)`` (not whole: a transfer wrote part of it), or None (the reader's own bytes, or a same-prefix
    request's: the same KV)."""
    recorded, writers = owner
    deep = _deep_parts(now)
    foreign = [i for i in deep if recorded[i] == now[i] and writers[i][0] != rid and writers[i][1] != key]
    if not foreign:
        return None
    return writers[foreign[0]], recorded == now


def _record_owner(slot: int, digest: RowHash, writer: Writer) -> None:
    """The row's bytes now, each part's writer: ``writer`` for what changed since the last record, else the earlier
    writer; a second record of the same request (freed, then released as finished) updates how (caller holds the
    lock)."""
    before = _owners.get(slot)
    if before is None or len(before[0]) != len(digest):
        _owners[slot] = (digest, (writer,) * len(digest))
        return
    kept = before[1]
    _owners[slot] = (digest, tuple(kept[i] if before[0][i] == digest[i] and kept[i][0] != writer[0] else writer
                                   for i in range(len(digest))))


def _pages(scheduler: Any, slots: list[int]) -> list[int]:
    page_size = int(getattr(scheduler, "page_size", None) or 1)
    return sorted({slot // page_size for slot in slots})


def _context_len(req: Any) -> int:
    return len(getattr(req, "origin_input_ids", None) or [])


def _full_len(req: Any) -> int:
    return _context_len(req) + len(getattr(req, "output_ids", None) or [])


_PREFIX_MOD = (1 << 61) - 1


def prefix_keys(token_ids: list[int], count: int) -> list[int]:
    """Per position ``i < count``: a rolling hash of ``token_ids[: i + 1]`` (equal keys: same prefix, same KV)."""
    keys, key = [], 0
    for token in token_ids[:count]:
        key = (key * 1_000_003 + int(token) + 1) % _PREFIX_MOD
        keys.append(key)
    return keys


def _tokens(req: Any) -> list[int]:
    return list(getattr(req, "origin_input_ids", None) or []) + list(getattr(req, "output_ids", None) or [])


def _first_decode(scheduler: Any, req: Any) -> None:
    slots = _slots(scheduler, req, _context_len(req))
    hashes = _row_hashes(scheduler, slots)
    mine = prefix_keys(_tokens(req), len(slots))
    matches: Counter[str] = Counter()
    same_prefix = partial = unfinished = 0
    with _lock:
        for slot, digest, key in zip(slots, hashes, mine, strict=True):
            owner = _owners.get(slot)
            if owner is None:
                continue
            found = foreign_parts(owner, digest, str(req.rid), key)
            if found is None:
                same_prefix += owner[0] == digest
                continue
            writer, whole = found
            matches[writer[0]] += 1
            partial += not whole
            unfinished += writer[2] == "freed"
    with _lock:
        _context_at_first_decode[req.rid] = (slots, hashes)
        committed = _context_at_commit.pop(req.rid, None)
    since_commit = _rows_changed(committed, slots, hashes)
    _emit(
        {
            "event": "first_decode",
            "rid": req.rid,
            "rows": len(slots),
            "slots_head": slots[:8],
            "pages": _pages(scheduler, slots),
            "foreign_rows": dict(matches),
            "foreign_total": sum(matches.values()),
            "same_prefix_rows": same_prefix,
            "partial_rows": partial,
            "foreign_from_unfinished": unfinished,
            "rows_changed_since_commit": since_commit,
        }
    )


def _rows_changed(before: tuple[list[int], list[RowHash]] | None, slots: list[int], hashes: list[RowHash]
                  ) -> int | None:
    """Rows (by slot) whose hash differs from an earlier look; None when there was no earlier look."""
    if before is None:
        return None
    now = dict(zip(slots, hashes, strict=True))
    return sum(1 for s, h in zip(*before, strict=True) if now.get(s, h) != h)


def _wrap_commit(original: Any) -> Any:
    @functools.wraps(original)  # keeps sglang-harden's hook marks visible through this wrapper (fail-closed check)
    def commit(self: Any, decode_req: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, decode_req, *args, **kwargs)
        try:
            req = decode_req.req
            slots = _slots(self.scheduler, req, _context_len(req))
            if slots:
                hashes = _row_hashes(self.scheduler, slots)
                with _lock:
                    _context_at_commit[req.rid] = (slots, hashes)
        except Exception as exc:  # a tracer must never take the server down
            _emit({"event": "error", "where": "commit", "error": repr(exc)})
        return out

    return commit


def _wrap_admit(original: Any) -> Any:
    @functools.wraps(original)
    def add(self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        try:  # which decode node took which request in (trace files are per scheduler process)
            _emit({"event": "admitted", "rid": req.rid})
        except Exception as exc:
            _emit({"event": "error", "where": "admit", "error": repr(exc)})
        return original(self, req, *args, **kwargs)

    return add


def _wrap_pre_alloc(original: Any) -> Any:
    @functools.wraps(original)
    def pre_alloc(self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, req, *args, **kwargs)
        try:
            slots = _slots(self.scheduler, req, _context_len(req))
            keys = prefix_keys(_tokens(req), len(slots))
            with _lock:
                for slot, key in zip(slots, keys, strict=True):
                    _holders[slot] = (str(req.rid), key)
            _watch_frees(self.scheduler)
        except Exception as exc:
            _emit({"event": "error", "where": "pre_alloc", "error": repr(exc)})
        return out

    return pre_alloc


def _watch_frees(scheduler: Any) -> None:
    """Wrap this scheduler's allocator (the instance, once) where SGLang's frees pass: ``free`` and, on a paged
    allocator, ``_release_page_ids``, which the segment frees of 0.5.19+ (``free_segments`` -> ``free_page_ids``)
    reach without passing ``free``. Freed slots with a known holder are recorded as that holder's, whatever path
    freed them."""
    allocator = scheduler.token_to_kv_pool_allocator
    if getattr(allocator, "_sglang_harden_kvtrace_free", False):
        return
    page_size = int(getattr(allocator, "page_size", None) or getattr(scheduler, "page_size", None) or 1)
    allocator.free = _recording(scheduler, allocator.free, "free", lambda index: index.tolist())
    if page_size > 1 and hasattr(allocator, "_release_page_ids"):
        allocator._release_page_ids = _recording(
            scheduler, allocator._release_page_ids, "release_pages",
            lambda *page_ids: _slots_of_pages(page_ids, page_size))
    allocator._sglang_harden_kvtrace_free = True


def _recording(scheduler: Any, original: Any, where: str, slots_of: Any) -> Any:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            if args and all(hasattr(a, "tolist") for a in args):
                _record_freed(scheduler, slots_of(*args))
        except Exception as exc:  # a tracer must never take the server down
            _emit({"event": "error", "where": where, "error": repr(exc)})
        return original(*args, **kwargs)

    return wrapper


def _slots_of_pages(page_ids: tuple[Any, ...], page_size: int) -> list[int]:
    return [page * page_size + i for ids in page_ids for page in ids.tolist() for i in range(page_size)]


def _record_freed(scheduler: Any, freed_slots: list[int]) -> None:
    with _lock:
        held = [(int(s), _holders.pop(int(s))) for s in freed_slots if int(s) in _holders]
    if not held:
        return
    hashes = _row_hashes(scheduler, [slot for slot, _ in held])
    with _lock:
        for (slot, (rid, key)), digest in zip(held, hashes, strict=True):
            _record_owner(slot, digest, (rid, key, "freed"))
    for rid, rows in Counter(rid for _, (rid, _) in held).items():
        _emit({"event": "freed", "rid": rid, "rows": rows})


def _patch_decode(module: ModuleType) -> None:
    queue = getattr(module, "DecodeTransferQueue", None)
    if queue is not None and hasattr(queue, "_commit_transfer_to_req"):
        wrap_methods_once(queue, "_sglang_harden_kvtrace", {"_commit_transfer_to_req": _wrap_commit})
    prealloc = getattr(module, "DecodePreallocQueue", None)
    if prealloc is not None and hasattr(prealloc, "add"):
        wrap_methods_once(prealloc, "_sglang_harden_kvtrace_admit", {"add": _wrap_admit})
    if prealloc is not None and hasattr(prealloc, "_pre_alloc"):
        wrap_methods_once(prealloc, "_sglang_harden_kvtrace_hold", {"_pre_alloc": _wrap_pre_alloc})


def _release(scheduler: Any, req: Any, slots: list[int]) -> None:
    hashes = _row_hashes(scheduler, slots)
    keys = prefix_keys(_tokens(req), len(slots))
    keys += [-1] * (len(slots) - len(keys))
    with _lock:
        for slot, digest, key in zip(slots, hashes, keys, strict=True):
            _record_owner(slot, digest, (str(req.rid), key, "finished"))
            _holders.pop(slot, None)
    with _lock:
        before = _context_at_first_decode.pop(req.rid, None)
    changed = _rows_changed(before, slots, hashes)  # prompt KV must not change while it decodes (late write)
    _emit(
        {
            "event": "release",
            "rid": req.rid,
            "rows": len(slots),
            "slots_head": slots[:8],
            "context_rows_changed": changed,
        }
    )


def _wrap_run_batch(original: Any) -> Any:
    def run_batch(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            if _is_decode(self) and batch is not None and batch.forward_mode.is_decode():
                for req in batch.reqs:
                    if req.rid not in _seen_decode:
                        _seen_decode.add(req.rid)
                        _first_decode(self, req)
        except Exception as exc:  # a tracer must never take the server down
            _emit({"event": "error", "where": "run_batch", "error": repr(exc)})
        return original(self, batch, *args, **kwargs)

    return run_batch


def _wrap_process_batch_result(original: Any) -> Any:
    def process_batch_result(self: Any, batch: Any, result: Any, *args: Any, **kwargs: Any) -> Any:
        before: list[tuple[Any, list[int]]] = []
        try:
            if _is_decode(self) and batch is not None:
                before = [(r, _slots(self, r, _full_len(r))) for r in batch.reqs if not r.finished()]
        except Exception as exc:
            _emit({"event": "error", "where": "snapshot", "error": repr(exc)})
        out = original(self, batch, result, *args, **kwargs)
        for req, slots in before:
            try:
                if req.finished() and slots:
                    _release(self, req, slots)
            except Exception as exc:
                _emit({"event": "error", "where": "release", "error": repr(exc)})
        return out

    return process_batch_result


def _patch_scheduler(module: ModuleType) -> None:
    wrappers = {"run_batch": _wrap_run_batch, "process_batch_result": _wrap_process_batch_result}
    wrap_methods_once(module.Scheduler, "_sglang_harden_kvtrace", wrappers)


def install() -> None:
    when_imported("sglang.srt.managers.scheduler", _patch_scheduler)
    when_imported("sglang.srt.disaggregation.decode", _patch_decode)
