"""Per-transfer KV digest (sglang-harden backport, not upstream SGLang code).

Invariant (sglang-harden's checksum guard): decode commits a transfer only if the KV rows it received digest, per
KV head, to what prefill digested over the rows it sent; a mismatch (a flipped bit, a row written by someone else,
a page left out) aborts the request with 500 before its first decode step. A publishing prefill whose digest does
not arrive in time leaves nothing to verify against: decode refuses the request (fails closed).

- ``publish_before_final_send`` (prefill, ``send_kv_chunk`` on the last chunk): this rank starts its digest of the
  request's KV rows for the range it sends (decode's cached prefix to the end) on the current stream, and a
  background thread waits for it and posts the packed shard to its own bootstrap server (or a notice of why there is
  none): the scheduler never waits for the GPU;
- ``add_routes`` (the bootstrap server): ``PUT /sglang_harden/digest`` (this host only), ``GET
  /sglang_harden/digests?room=R`` and the feed ``GET /sglang_harden/digest_feed``, the plugin's routes; with the
  control-plane patch's secret every route and request is authenticated like the rest;
- ``GATE_STEP`` (the commit-gate patch's, 0.5.19+): when the transfer reports success, a pool thread fetches the
  room's shards from prefill's bootstrap server (waiting up to ``SGLANG_HARDEN_CHECKSUM_WAIT_MS``, default 5000),
  then decode digests its own rows on a private stream and the gate compares per head once both are on the host; a
  refusal fails the transfer on every TP rank. ``refusal_at_commit`` (series without the gate): the same at the
  commit, waiting; decode's TP ranks agree (any rank's refusal aborts on all).

The digest, the wire format, the board, the client and the comparison are sglang-harden's own code
(``kernels/digest_spec.py``, ``kernels/digest_torch.py``, ``guards/checksum.py``, ``compat/digest_pool.py``,
``compat/digest_board.py``, ``compat/digest_channel.py``), put in below when the series is generated, so patched
and plugin nodes check each other's transfers. ``SGLANG_HARDEN_CHECKSUM``: ``enforce`` (default), ``log`` (log a
refusal, decode anyway), ``off`` (no digest published or checked). Any other value refuses to start.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from enum import Enum

logger = logging.getLogger(__name__)

MODE_ENV = "SGLANG_HARDEN_CHECKSUM"
WAIT_ENV = "SGLANG_HARDEN_CHECKSUM_WAIT_MS"
BODY_LIMIT = 256 * 1024


class _AuthSigner:
    """The control-plane patch's signer (``pd_auth.SIGNER``), looked up at each request: the token of a request to
    a bootstrap server ({} without a secret) and the check of its answer."""

    def headers(self, method: str, authority: str, target: str, body: object) -> dict:
        from sglang.srt.disaggregation.common import pd_auth

        return pd_auth.SIGNER.headers(method, authority, target, body)

    def answer_refusal(self, sent: object, status: int, answer: object, body: bytes, **about: object) -> object:
        from sglang.srt.disaggregation.common import pd_auth

        return pd_auth.SIGNER.answer_refusal(sent, status, answer, body, **about)


class _Signing:
    """sglang-harden's ``compat.signing`` here: one kept-alive client whose requests carry pd_auth's token and
    whose answers pd_auth checks."""

    @property
    def CLIENT(self) -> object:  # noqa: N802 - the plugin module's name
        return SideChannelClient(_AuthSigner())


signing = _Signing()

# <prelude>


# <bundle sglang_harden/guards/base.py sglang_harden/kernels/digest_spec.py sglang_harden/kernels/digest_ref.py sglang_harden/kernels/digest_torch.py sglang_harden/guards/checksum.py sglang_harden/kernels/device.py sglang_harden/kernels/digest_launch.py sglang_harden/compat/digest_pool.py sglang_harden/compat/digest_board.py sglang_harden/compat/digest_verify.py sglang_harden/channels/http_client.py sglang_harden/compat/digest_channel.py sglang_harden/compat/side_routes.py>


# ---- the backport's own glue: SGLang's objects in, the guard's decisions out

log = logging.getLogger(__name__)
MODE = mode_from_env(MODE_ENV)


def _wait_s_from_env() -> float:
    raw = os.environ.get(WAIT_ENV, "").strip() or "5000"
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{WAIT_ENV}={raw!r}: expected milliseconds") from None
    if value <= 0:
        raise ValueError(f"{WAIT_ENV}={raw!r}: must be positive")
    return value / 1000


WAIT_S = _wait_s_from_env()
PUBLISHER: DigestPublisher | None = None


def _pool_row(req: Any) -> int:
    kv = getattr(req, "kv", None)
    row = getattr(kv, "req_pool_idx", None) if kv is not None else None
    return int(row if row is not None else req.req_pool_idx)


def _sums_on_device(k_buffers: Any, v_buffers: Any, slots: Any, layout: Any, start: int) -> Any:
    """The Triton kernel (``pd_digest_triton``) where the pool is on CUDA and the tree has Triton, else torch."""
    if getattr(k_buffers[0], "is_cuda", False):
        try:
            from sglang.srt.disaggregation.common import pd_digest_triton
        except ImportError:  # no Triton here: the torch path digests alike
            pass
        else:
            return pd_digest_triton.sums_triton(k_buffers, v_buffers, slots, layout, start)
    return sums_torch(k_buffers, v_buffers, slots, layout, start)


# the plugin's kernels (on the host at once; on a GPU the sums, copied without waiting)
KERNELS = {"on_host": digest_torch, "on_device": _sums_on_device}
FETCH_THREADS = 16
_FETCHER: ThreadPoolExecutor | None = None


def _digest_rows(scheduler: Any, row: int, start: int, end: int) -> tuple[ShardDigest | None, str]:
    """This rank's digest of ``req_to_token[row, start:end]``'s KV rows, waited for (the series without the gate)."""
    pending, reason = launch_digest_rows(scheduler, row, start, end, **KERNELS)
    if pending is None:
        return None, reason
    pending.wait()
    return pending.shard(), ""


def _fetch(addr: str, room: int, enough: Any) -> Any:
    """Prefill's shards of ``room``, fetched by a pool thread (at most ``WAIT_S``): never the scheduler's."""
    global _FETCHER
    if _FETCHER is None:
        _FETCHER = ThreadPoolExecutor(max_workers=FETCH_THREADS, thread_name_prefix="sglang-harden-digest-fetch")
    return _FETCHER.submit(fetch_digests, addr, room, WAIT_S, enough)


# ---- prefill


def publish_before_final_send(scheduler: Any, req: Any, end_idx: Any) -> None:
    """On the last chunk: publish this rank's digest of every row the request sends, or why there is none."""
    global PUBLISHER

    room = getattr(req, "bootstrap_room", None)
    if MODE == "off" or room is None:
        return
    if PUBLISHER is None:
        PUBLISHER = DigestPublisher(bootstrap_base_url(scheduler))
    code = NOTICE_NOT_DIGESTIBLE
    rank = _tp_rank(scheduler)
    try:
        start = int(getattr(req, "disagg_decode_prefix_len", 0) or 0)
        pending, reason = launch_digest_rows(scheduler, _pool_row(req), start, int(end_idx), **KERNELS)
    except Exception as exc:  # noqa: BLE001 - never break a send; decode is told and refuses the request
        pending, reason, code = None, f"digest failed: {exc!r}", NOTICE_FAILED
    if pending is None:
        log.warning("sglang-harden checksum: no KV digest for request %s: %s", req.rid, reason)
        PUBLISHER.publish(PublishedShard(int(room), rank, tuple(pack_notice(rank, code))))
    else:
        PUBLISHER.publish_when_ready(lambda: published_when_landed(int(room), rank, pending))


# ---- prefill's bootstrap server


def add_routes(app: Any) -> None:
    """The digest board's routes on the bootstrap server's aiohttp app."""
    app.router.add_route("PUT", DIGEST_PATH, _handle_put)
    app.router.add_route("GET", DIGESTS_PATH, _handle_digests)
    app.router.add_route("GET", FEED_PATH, _handle_feed)


async def _handle_put(request: Any) -> Any:
    from sglang.srt.disaggregation.common.pd_rejections import request_from_this_host

    return await accept_from_this_host(request, "digests", BODY_LIMIT, parse_digest_body, post_and_signal,
                                       request_from_this_host)


async def _handle_digests(request: Any) -> Any:
    from aiohttp import web

    try:
        room = int(request.query.get("room", ""))
    except ValueError:
        return web.json_response({"error": "room must be an integer"}, status=400)
    return web.json_response(digests_payload(room, MODE != "off"))


async def _handle_feed(request: Any) -> Any:
    from aiohttp import web

    try:
        ask = parse_feed_query(dict(request.query))
    except ValueError as exc:
        return web.json_response({"error": str(exc)}, status=400)
    if not feed_has_news(ask) and ask.wait_s > 0:
        await POSTED.wait(ask.wait_s)
    return web.json_response(feed_payload(ask, MODE != "off"))


# ---- decode


def refusal_at_commit(req: Any, scheduler: Any, receiver: Any, group: Any) -> str | None:
    """The message to abort ``req`` with before its transfer is committed (enforce mode), else None."""
    if MODE == "off":
        return None
    rid = str(req.rid)
    try:
        local = _compare_with_prefill(req, scheduler, str(getattr(receiver, "bootstrap_addr", "")))
    except Exception as exc:  # noqa: BLE001 - cannot decide: fail closed, on this rank and so on all
        local = unverifiable(rid, repr(exc))
    decision = _agreed(group, local, rid)
    if decision.verdict is Verdict.SKIP:
        log.warning("sglang-harden checksum skip: rid=%s room=%s: %s", rid, req.bootstrap_room, decision.reason)
        return None
    if decision.allows:
        return None
    log.error("sglang-harden checksum %s: rid=%s room=%s: %s", "abort" if MODE == "enforce" else
              "abort_logged (log mode: decoding anyway)", rid, req.bootstrap_room, decision.reason)
    return decision.reason if MODE == "enforce" else None


def _compare_with_prefill(req: Any, scheduler: Any, addr: str) -> Decision:
    rid = str(req.rid)
    layout, _, _, reason = pool_layout(scheduler)
    if layout is None:
        return not_comparable(rid, reason)
    mine = set(layout.heads)

    def decidable(shards: dict[int, tuple[int, ...]]) -> bool:
        covered = {h for s in published_shards(shards) for h in s.layout.heads}
        return bool(notices_in(shards)) or mine <= covered

    fetched = fetch_digests(addr, int(req.bootstrap_room), WAIT_S, decidable)
    notices = notices_in(fetched.shards)
    if notices:
        return decide_on_notices(rid, notices)
    if fetched.timed_out:
        return unverifiable(rid, fetched.reason)
    published = published_shards(fetched.shards)
    if not published:
        return not_comparable(rid, fetched.reason or "prefill published no digest")
    start = min(s.start_token for s in published)
    shard, reason = _digest_rows(scheduler, _pool_row(req), start, len(req.origin_input_ids))
    if shard is None:
        return not_comparable(rid, reason)
    return compare(published, shard, rid)


def _agreed(group: Any, local: Decision, rid: str) -> Decision:
    """One outcome for every rank of decode's TP group (a lone rank agrees with itself)."""
    import torch.distributed as dist

    if group is None or not dist.is_initialized() or dist.get_world_size(group) <= 1:
        return local
    return agree_across_ranks([local], TorchGroupTransport(group), AGREE_TIMEOUT_S, [rid])[0]


AGREE_TIMEOUT_S = 10.0
GATE_STEP = ChecksumGateStep(_pool_row, _fetch, **KERNELS)
