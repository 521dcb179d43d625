"""The checksum guard on a scheduler's KV pool without the host waiting for the GPU: a rank's digest of a request's
rows (:func:`launch_digest_rows`) and decode's step at the commit gate (:class:`ChecksumGateStep`). Shared by the
plugin (``compat/kv_digest.py``) and the backport series (bundled into its ``pd_digest``), so both verify alike.

The step fetches prefill's digests off the scheduler thread (``fetch`` returns a future; the caller's thread pool
waits, at most the checksum wait), then digests the same rows on a private stream and compares per head once both
are on the host. Nothing here waits on the scheduler thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from sglang_harden.compat.digest_board import PublishedShard
from sglang_harden.compat.digest_pool import _tp_rank, pool_layout
from sglang_harden.guards.base import Decision
from sglang_harden.guards.checksum import (
    NOTICE_FAILED,
    compare,
    decide_on_notices,
    not_comparable,
    notices_in,
    pack_notice,
    pack_shard,
    published_shards,
    unverifiable,
)
from sglang_harden.kernels.device import on_accelerator, side_stream
from sglang_harden.kernels.digest_launch import PendingDigest, launch_digest

logger = logging.getLogger("sglang_harden")

# (prefill's bootstrap address, room, enough(shards) -> bool) -> a future of what was fetched (digest_channel.Fetched)
Fetch = Callable[[str, int, Callable[[dict[int, tuple[int, ...]]], bool]], "Future[Any]"]


def launch_digest_rows(scheduler: Any, row: int, start: int, end: int, stream: Any = None,
                       **kernels: Any) -> tuple[PendingDigest | None, str]:
    """Start this rank's digest of the request's KV rows ``[start, end)`` (``req_to_token[row]``) on ``stream``
    (``kernels``: :func:`~sglang_harden.kernels.digest_launch.launch_digest`'s ``on_host`` / ``on_device``)."""
    layout, k_buffers, v_buffers, reason = pool_layout(scheduler)
    if layout is None:
        return None, reason
    slots = scheduler.req_to_token_pool.req_to_token[row, start:end].to(k_buffers[0].device).long()
    return launch_digest(k_buffers, v_buffers, slots, layout, start, _tp_rank(scheduler), stream, **kernels), ""


def published_when_landed(room: int, rank: int, pending: PendingDigest) -> PublishedShard:
    """Prefill's post of its digest once it landed (called on the publisher's thread, which waits for it; never on
    the scheduler's), or a notice that the digest failed (decode then refuses the request)."""
    try:
        pending.wait()
        shard = pending.shard()
    except Exception as exc:  # noqa: BLE001 - decode is told and refuses the request
        logger.warning("sglang-harden: the KV digest of room %s failed: %r", room, exc)
        return PublishedShard(room, rank, tuple(pack_notice(rank, NOTICE_FAILED)))
    return PublishedShard(room, shard.rank, tuple(pack_shard(shard)))


@dataclass
class Verifying:
    """The step's work for one room: prefill's digests on their way, then this rank's own digest of the rows."""

    fetch: Future[Any]
    local: PendingDigest | None = None
    published: list[Any] = field(default_factory=list)


class ChecksumGateStep:
    """Decode's checksum step of the commit gate. ``pool_row(req)``: the request's row in ``req_to_token``;
    ``fetch``: see :data:`Fetch`; ``kernels``: passed to :func:`launch_digest_rows`."""

    def __init__(self, pool_row: Callable[[Any], int], fetch: Fetch, **kernels: Any) -> None:
        self.pool_row, self.fetch, self.kernels = pool_row, fetch, kernels

    def launch(self, queue: Any, decode_req: Any) -> Any:
        req = decode_req.req
        layout, _, _, reason = pool_layout(queue.scheduler)
        if layout is None:
            return not_comparable(str(req.rid), reason)
        mine = set(layout.heads)

        def decidable(shards: dict[int, tuple[int, ...]]) -> bool:
            covered = {h for s in published_shards(shards) for h in s.layout.heads}
            return bool(notices_in(shards)) or mine <= covered

        addr = str(getattr(decode_req.kv_receiver, "bootstrap_addr", ""))
        return Verifying(self.fetch(addr, int(req.bootstrap_room), decidable))

    def decide(self, queue: Any, decode_req: Any, pending: Any) -> Decision | None:
        if isinstance(pending, Decision):
            return pending
        try:
            return self._decide(queue, decode_req, pending)
        except Exception as exc:  # noqa: BLE001 - cannot decide: fail closed
            return unverifiable(str(decode_req.req.rid), repr(exc))

    def _decide(self, queue: Any, decode_req: Any, work: Verifying) -> Decision | None:
        req = decode_req.req
        rid = str(req.rid)
        if work.local is None:
            if not work.fetch.done():
                return None
            fetched = work.fetch.result()
            notices = notices_in(fetched.shards)
            if notices:
                return decide_on_notices(rid, notices)
            if fetched.timed_out:
                return unverifiable(rid, fetched.reason)
            work.published = published_shards(fetched.shards)
            if not work.published:
                return not_comparable(rid, fetched.reason or "prefill published no digest")
            start = min(s.start_token for s in work.published)
            scheduler = queue.scheduler
            row = self.pool_row(req)
            table = scheduler.req_to_token_pool.req_to_token
            stream = side_stream(table.device) if on_accelerator(table) else None
            local, reason = launch_digest_rows(scheduler, row, start, len(req.origin_input_ids), stream,
                                               **self.kernels)
            if local is None:
                return not_comparable(rid, reason)
            work.local = local
        if not work.local.ready():
            return None
        return compare(work.published, work.local.shard(), rid)
