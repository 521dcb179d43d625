"""Checksum hooks: prefill publishes per-KV-head digests of the KV it sends; decode verifies before commit.

Prefill, when a request's final chunk is about to be sent, digests the request's KV rows for exactly the
token range it sends (``[decode's cached prefix, sent end)``) on each TP rank and posts the packed shard to its
bootstrap server (:mod:`.digest_channel`, posted by a background thread as the send is issued), or a notice
saying why it has none.
Decode, before committing a finished transfer, digests the rows at its own slots for ``[prefill's start,
reserved length)``, compares per head (:func:`checksum.compare`), and when its TP group has more than one rank,
agrees with the other ranks over the queue's gloo group within a bound (:func:`checksum.agree_across_ranks`).
The decision is applied through the same abort as coverage. A publishing prefill whose digest does not arrive
within ``checksum_wait_ms`` leaves nothing to verify against: decode refuses the request (fails closed).

Family differences (how a ``Req`` names its pool row and sent range, how decode aborts) come in as a
:class:`DigestReader`; this module itself touches only the KV pool (``k_buffer``/``v_buffer`` or MLA's
``kv_buffer``), ``model_config`` and the scheduler's TP coordinates.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sglang_harden import events
from sglang_harden.compat import digest_channel
from sglang_harden.compat.digest_pool import (  # noqa: F401 - re-exported: tests and shims read them here
    TorchGroupTransport,
    _parallel_context,
    _tp_coordinates,
    _tp_rank,
    pool_layout,
)
from sglang_harden.compat.runtime import RUNTIME
from sglang_harden.config import Mode
from sglang_harden.guards import checksum
from sglang_harden.guards.base import Decision
from sglang_harden.kernels.digest import shard_digest
from sglang_harden.kernels.digest_spec import ShardDigest

logger = logging.getLogger("sglang_harden")

Func = Callable[..., Any]
AGREE_TIMEOUT_S = 10.0


class DigestTimer:
    """Time the digest adds to requests in this process (prefill: digest + publish; decode: fetch, recompute,
    compare, agree), reported on ``/server_info`` so a benchmark can put it next to request latency."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats: dict[str, list[float]] = {}

    def add(self, what: str, seconds: float) -> None:
        with self._lock:
            count, total, worst = self._stats.get(what, (0, 0.0, 0.0))
            self._stats[what] = [count + 1, total + seconds, max(worst, seconds)]

    def report(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {
                what: {"count": int(c), "mean_us": round(t / c * 1e6, 1), "max_us": round(w * 1e6, 1)}
                for what, (c, t, w) in self._stats.items()
                if c
            }


TIMER = DigestTimer()


@dataclass(frozen=True)
class DigestReader:
    """Per-family access: a request's row in ``req_to_token``, the token range prefill sends on its last
    chunk (``(scheduler, req, end_idx)`` -> ``(start, end)``), whether a decode request is the warm-up's
    fake transfer, and how decode aborts a transferred request with a decision."""

    pool_row: Callable[[Any], int]
    sent_range: Callable[[Any, Any, Any], tuple[int, int]]
    is_fake_transfer: Callable[[Any], bool]
    abort_transferred: Callable[[Any, Any, Decision], None]


# ---------------------------------------------------------------------------------------------- layout


def digest_rows(scheduler: Any, row: int, start: int, end: int) -> tuple[ShardDigest | None, str]:
    """This rank's digest of the request's KV rows ``[start, end)`` (``req_to_token[row]``)."""
    layout, k_buffers, v_buffers, reason = pool_layout(scheduler)
    if layout is None:
        return None, reason
    slots = scheduler.req_to_token_pool.req_to_token[row, start:end].to(k_buffers[0].device).long()
    return shard_digest(k_buffers, v_buffers, slots, layout, start_token=start, rank=_tp_rank(scheduler)), ""


# ---------------------------------------------------------------------------------------------- prefill


def publish_sent_digest(reader: DigestReader) -> Callable[[Func], Func]:
    """``send_kv_chunk(req, last_chunk, end_idx)``: before the final chunk goes out, publish this rank's digest
    of every row the request sends, or a notice of why there is none (decode skips an undigestible layout and
    refuses a failed digest)."""

    def make(original: Func) -> Func:
        def send_kv_chunk(self: Any, req: Any, last_chunk: bool = False, end_idx: Any = None) -> Any:
            if last_chunk and RUNTIME.config.checksum is not Mode.OFF and RUNTIME.digest_publisher is not None:
                began = time.perf_counter()
                _publish(self, req, reader, end_idx)
                TIMER.add("publish", time.perf_counter() - began)
            return original(self, req, last_chunk, end_idx)

        return send_kv_chunk

    return make


def _publish(scheduler: Any, req: Any, reader: DigestReader, end_idx: Any) -> None:
    room = getattr(req, "bootstrap_room", None)
    if room is None:
        return
    code = checksum.NOTICE_NOT_DIGESTIBLE
    began = time.perf_counter()
    try:
        start, end = reader.sent_range(scheduler, req, end_idx)
        shard, reason = digest_rows(scheduler, reader.pool_row(req), start, end)
        TIMER.add("publish.digest", time.perf_counter() - began)
    except Exception as exc:  # noqa: BLE001 - never break a send; decode is told and refuses the request
        shard, reason, code = None, f"digest failed: {exc!r}", checksum.NOTICE_FAILED
    if shard is None:
        logger.warning("sglang-harden: no KV digest for request %s: %s", req.rid, reason)
        rank = _tp_rank(scheduler)
        published = digest_channel.PublishedShard(int(room), rank, tuple(checksum.pack_notice(rank, code)))
    else:
        published = digest_channel.PublishedShard(int(room), shard.rank, tuple(checksum.pack_shard(shard)))
    publisher = RUNTIME.digest_publisher
    assert publisher is not None
    publisher.publish(published)


# ----------------------------------------------------------------------------------------------- decode


def verify_before_commit(reader: DigestReader) -> Callable[[Any, Any, dict[str, Any]], bool]:
    """Commit-chain step (``DecodeTransferQueue._commit_transfer_to_req``): every rank verifies its shard, the
    ranks agree, and a mismatch aborts the request before its first decode step."""

    def checksum_step(queue: Any, decode_req: Any, _context: dict[str, Any]) -> bool:
        mode = RUNTIME.config.checksum
        req = decode_req.req
        if mode is Mode.OFF or reader.is_fake_transfer(req):
            return False
        began = time.perf_counter()
        decision = agree_on_group(queue, _local_decision(queue, decode_req, reader), str(req.rid))
        TIMER.add("verify", time.perf_counter() - began)
        if events.record(decision, mode, room=getattr(req, "bootstrap_room", None)):
            reader.abort_transferred(queue, decode_req, decision)
            return True
        return False

    return checksum_step


def _local_decision(queue: Any, decode_req: Any, reader: DigestReader) -> Decision:
    req = decode_req.req
    rid = str(req.rid)
    try:
        return _compare_with_prefill(queue.scheduler, decode_req, reader)
    except Exception as exc:  # noqa: BLE001 - cannot decide: fail closed, on this rank and so on all
        return checksum.unverifiable(rid, repr(exc))


def _compare_with_prefill(scheduler: Any, decode_req: Any, reader: DigestReader) -> Decision:
    req = decode_req.req
    rid = str(req.rid)
    layout, _, _, reason = pool_layout(scheduler)
    if layout is None:
        return checksum.not_comparable(rid, reason)
    mine = set(layout.heads)
    addr = str(getattr(decode_req.kv_receiver, "bootstrap_addr", ""))

    def decidable(shards: dict[int, tuple[int, ...]]) -> bool:
        covered = {h for s in checksum.published_shards(shards) for h in s.layout.heads}
        return bool(checksum.notices_in(shards)) or mine <= covered

    wait_s = RUNTIME.config.checksum_wait_ms / 1000
    began = time.perf_counter()
    fetched = digest_channel.receive_digests(RUNTIME.feed, addr, int(req.bootstrap_room), wait_s, decidable)
    fetch_s = time.perf_counter() - began
    TIMER.add("verify.fetch", fetch_s)
    TIMER.add(f"verify.fetch.{fetched.via}", fetch_s)
    notices = checksum.notices_in(fetched.shards)
    if notices:
        return checksum.decide_on_notices(rid, notices)
    if fetched.timed_out:
        return checksum.unverifiable(rid, fetched.reason)
    published = checksum.published_shards(fetched.shards)
    if not published:
        return checksum.not_comparable(rid, fetched.reason or "prefill published no digest")
    start = min(s.start_token for s in published)
    shard, reason = digest_rows(scheduler, reader.pool_row(req), start, len(req.origin_input_ids))
    if shard is None:
        return checksum.not_comparable(rid, reason)
    return checksum.compare(published, shard, rid)


def agree_on_group(queue: Any, local: Decision, rid: str) -> Decision:
    """One outcome for every rank of decode's TP group (a lone rank agrees with itself); ranks commit the same
    requests in the same order (their polls are all-reduced), so the exchange pairs up."""
    group = getattr(queue, "gloo_group", None)
    if group is None or _world_size(group) <= 1:
        return local
    transport = TorchGroupTransport(group)
    return checksum.agree_across_ranks([local], transport, AGREE_TIMEOUT_S, [rid])[0]


def _world_size(group: Any) -> int:
    import torch.distributed as dist

    return int(dist.get_world_size(group)) if dist.is_initialized() else 1
