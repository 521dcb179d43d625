"""Checksum hooks: prefill publishes per-KV-head digests of the KV it sends; decode verifies before commit.

Prefill, when a request's final chunk is about to be sent, digests the request's KV rows for exactly the
token range it sends (``[decode's cached prefix, sent end)``) on each TP rank and posts the packed shard to its
bootstrap server (:mod:`.digest_channel`), or a notice saying why it has none. The digest runs on the current
stream (after the forward that wrote the rows, before anything that could overwrite them); the publisher's
background thread waits for it and posts it, never the scheduler.
Decode, when the transfer reports success (a step of the commit gate, :mod:`.commit_gate`), fetches prefill's
digests off the scheduler thread, digests the rows at its own slots for ``[prefill's start, reserved length)`` on
a private stream, and compares per head (:func:`checksum.compare`) once both are on the host. TP ranks agree
through the gate (a refusal fails the transfer on every rank). A publishing prefill whose digest does not arrive
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
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sglang_harden.compat import digest_channel
from sglang_harden.compat.digest_pool import (  # noqa: F401 - re-exported: tests and shims read them here
    _parallel_context,
    _tp_coordinates,
    _tp_rank,
    pool_layout,
)
from sglang_harden.compat.runtime import RUNTIME
from sglang_harden.config import Mode
from sglang_harden.guards import checksum
from sglang_harden.guards.base import Decision
from sglang_harden.kernels.device import on_accelerator, side_stream
from sglang_harden.kernels.digest_launch import PendingDigest, launch_digest
from sglang_harden.kernels.digest_spec import ShardDigest

logger = logging.getLogger("sglang_harden")

Func = Callable[..., Any]
FETCH_THREADS = 16
_FETCHER: ThreadPoolExecutor | None = None


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


def launch_digest_rows(scheduler: Any, row: int, start: int, end: int,
                       stream: Any = None) -> tuple[PendingDigest | None, str]:
    """Start this rank's digest of the request's KV rows ``[start, end)`` (``req_to_token[row]``) on ``stream``."""
    layout, k_buffers, v_buffers, reason = pool_layout(scheduler)
    if layout is None:
        return None, reason
    slots = scheduler.req_to_token_pool.req_to_token[row, start:end].to(k_buffers[0].device).long()
    return launch_digest(k_buffers, v_buffers, slots, layout, start, _tp_rank(scheduler), stream), ""


def digest_rows(scheduler: Any, row: int, start: int, end: int) -> tuple[ShardDigest | None, str]:
    """This rank's digest of the request's KV rows ``[start, end)``, waited for (tests and tools only)."""
    pending, reason = launch_digest_rows(scheduler, row, start, end)
    if pending is None:
        return None, reason
    pending.wait()
    return pending.shard(), ""


# ---------------------------------------------------------------------------------------------- prefill


def publish_sent_digest(reader: DigestReader) -> Callable[[Func], Func]:
    """``send_kv_chunk(req, last_chunk, end_idx)``: before the final chunk goes out, start this rank's digest of
    every row the request sends on the current stream (after the forward that wrote them, before anything that
    could overwrite them) and hand it to the publisher, whose thread posts it once it landed; or publish a notice
    of why there is none (decode skips an undigestible layout and refuses a failed digest)."""

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
    rank = _tp_rank(scheduler)
    publisher = RUNTIME.digest_publisher
    assert publisher is not None
    try:
        start, end = reader.sent_range(scheduler, req, end_idx)
        pending, reason = launch_digest_rows(scheduler, reader.pool_row(req), start, end)
    except Exception as exc:  # noqa: BLE001 - never break a send; decode is told and refuses the request
        pending, reason = None, f"digest failed: {exc!r}"
        code = checksum.NOTICE_FAILED
    else:
        code = checksum.NOTICE_NOT_DIGESTIBLE
    if pending is None:
        logger.warning("sglang-harden: no KV digest for request %s: %s", req.rid, reason)
        publisher.publish(digest_channel.PublishedShard(int(room), rank, tuple(checksum.pack_notice(rank, code))))
        return
    publisher.publish_when_ready(lambda: _landed(int(room), rank, pending))


def _landed(room: int, rank: int, pending: PendingDigest) -> digest_channel.PublishedShard:
    """The published shard once the digest landed (the publisher's thread waits for it, never the scheduler)."""
    try:
        pending.wait()
        shard = pending.shard()
    except Exception as exc:  # noqa: BLE001 - decode is told and refuses the request
        logger.warning("sglang-harden: the KV digest of room %s failed: %r", room, exc)
        return digest_channel.PublishedShard(room, rank, tuple(checksum.pack_notice(rank, checksum.NOTICE_FAILED)))
    return digest_channel.PublishedShard(room, shard.rank, tuple(checksum.pack_shard(shard)))


# ----------------------------------------------------------------------------------------------- decode


@dataclass
class _Verifying:
    """The checksum step's work for one room: prefill's digests on their way (a background fetch), then this
    rank's own digest of the same rows."""

    fetch: Future[digest_channel.Fetched]
    began: float
    layout_heads: frozenset[int] = frozenset()
    local: PendingDigest | None = None
    published: list[Any] = field(default_factory=list)


def _fetcher() -> ThreadPoolExecutor:
    global _FETCHER
    if _FETCHER is None:
        _FETCHER = ThreadPoolExecutor(max_workers=FETCH_THREADS, thread_name_prefix="sglang-harden-digest-fetch")
    return _FETCHER


class ChecksumStep:
    """The commit gate's checksum step: fetch prefill's digests off the scheduler thread, then digest the same rows
    here on the private stream, compare once both are on the host. Waits at most ``checksum_wait_ms`` for
    prefill's digests (fails closed after)."""

    def __init__(self, reader: DigestReader) -> None:
        self.reader = reader

    def launch(self, queue: Any, decode_req: Any) -> Any:
        req = decode_req.req
        layout, _, _, reason = pool_layout(queue.scheduler)
        if layout is None:
            return checksum.not_comparable(str(req.rid), reason)
        mine = frozenset(layout.heads)

        def decidable(shards: dict[int, tuple[int, ...]]) -> bool:
            covered = {h for s in checksum.published_shards(shards) for h in s.layout.heads}
            return bool(checksum.notices_in(shards)) or mine <= covered

        addr = str(getattr(decode_req.kv_receiver, "bootstrap_addr", ""))
        wait_s = RUNTIME.config.checksum_wait_ms / 1000
        fetch = _fetcher().submit(digest_channel.receive_digests, RUNTIME.feed, addr, int(req.bootstrap_room),
                                  wait_s, decidable)
        return _Verifying(fetch, time.perf_counter(), mine)

    def decide(self, queue: Any, decode_req: Any, pending: Any) -> Decision | None:
        if isinstance(pending, Decision):
            return pending
        rid = str(decode_req.req.rid)
        try:
            return self._decide(queue, decode_req, pending)
        except Exception as exc:  # noqa: BLE001 - cannot decide: fail closed
            return checksum.unverifiable(rid, repr(exc))

    def _decide(self, queue: Any, decode_req: Any, work: _Verifying) -> Decision | None:
        req = decode_req.req
        rid = str(req.rid)
        if work.local is None:
            if not work.fetch.done():
                return None
            fetched = work.fetch.result()
            TIMER.add("verify.fetch", time.perf_counter() - work.began)
            notices = checksum.notices_in(fetched.shards)
            if notices:
                return checksum.decide_on_notices(rid, notices)
            if fetched.timed_out:
                return checksum.unverifiable(rid, fetched.reason)
            work.published = checksum.published_shards(fetched.shards)
            if not work.published:
                return checksum.not_comparable(rid, fetched.reason or "prefill published no digest")
            start = min(s.start_token for s in work.published)
            scheduler = queue.scheduler
            row = scheduler.req_to_token_pool.req_to_token[self.reader.pool_row(req)]
            stream = side_stream(row.device) if on_accelerator(row) else None
            local, reason = launch_digest_rows(scheduler, self.reader.pool_row(req), start,
                                               len(req.origin_input_ids), stream)
            if local is None:
                return checksum.not_comparable(rid, reason)
            work.local = local
        if not work.local.ready():
            return None
        TIMER.add("verify", time.perf_counter() - work.began)
        return checksum.compare(work.published, work.local.shard(), rid)
