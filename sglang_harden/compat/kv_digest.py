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
from dataclasses import dataclass
from typing import Any

from sglang_harden.compat import digest_channel
from sglang_harden.compat import digest_verify as verify
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
from sglang_harden.kernels.digest import compute_digests, triton_available
from sglang_harden.kernels.digest_launch import PendingDigest
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


# ---------------------------------------------------------------------------------------------- kernels


def _triton_sums(k_buffers: Any, v_buffers: Any, slots: Any, layout: Any, start: int) -> Any:
    """The per-head sums from the pool's cached Triton digester (CUDA with Triton), else the torch path."""
    if k_buffers[0].is_cuda and triton_available():
        from sglang_harden.kernels.digest_triton import sums_triton

        return sums_triton(k_buffers, v_buffers, slots, layout, start)
    from sglang_harden.kernels.digest_torch import sums_torch

    return sums_torch(k_buffers, v_buffers, slots, layout, start)


KERNELS: dict[str, Any] = {"on_host": compute_digests, "on_device": _triton_sums}


def launch_digest_rows(scheduler: Any, row: int, start: int, end: int,
                       stream: Any = None) -> tuple[PendingDigest | None, str]:
    return verify.launch_digest_rows(scheduler, row, start, end, stream, **KERNELS)


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
    publisher.publish_when_ready(lambda: verify.published_when_landed(int(room), rank, pending))


# ----------------------------------------------------------------------------------------------- decode


def _fetcher() -> ThreadPoolExecutor:
    global _FETCHER
    if _FETCHER is None:
        _FETCHER = ThreadPoolExecutor(max_workers=FETCH_THREADS, thread_name_prefix="sglang-harden-digest-fetch")
    return _FETCHER


def _fetch(addr: str, room: int, enough: Callable[[dict[int, tuple[int, ...]]], bool]) -> Future[Any]:
    """Prefill's digests of ``room``, fetched by a pool thread (the feed, else the board; at most the wait)."""
    wait_s = RUNTIME.config.checksum_wait_ms / 1000
    return _fetcher().submit(digest_channel.receive_digests, RUNTIME.feed, addr, room, wait_s, enough)


def checksum_step(reader: DigestReader) -> verify.ChecksumGateStep:
    """The commit gate's checksum step (:class:`.digest_verify.ChecksumGateStep`) with the plugin's kernels."""
    return verify.ChecksumGateStep(reader.pool_row, _fetch, **KERNELS)
