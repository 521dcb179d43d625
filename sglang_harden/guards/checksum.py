"""Checksum guard: decode attends only over KV bytes that are exactly what prefill sent for this request.

Invariant: before decode commits a transferred request, every decode rank has recomputed the per-KV-head
digest (:mod:`sglang_harden.kernels.digest_spec`) over the pages it received, compared it with the digests
prefill published for the same global heads, and all ranks of the TP/PP group have agreed on one outcome.
A definite mismatch on any rank aborts the request on every rank; a rank that does not report within the
bound counts as an abort; nothing ever waits unboundedly.

Three outcomes per rank (:func:`compare`):

* ALLOW - every head this rank holds was verified.
* ABORT - a head's digest differs from the one prefill published for it (flipped bit, stale or foreign
  page, page never written), or prefill vouched for a different token range than decode is about to read
  (short send). The decision names the heads and the prefill rank.
* SKIP  - not comparable, with the reason logged: prefill does not publish digests (not hardened, or its
  checksum guard off) or told decode it cannot digest its KV layout, a different layout signature (dtype,
  head_dim, layer count, K/V halves, total KV heads), a head no prefill rank published, or replicas of a
  replicated head (MLA latent, TP wider than the KV heads) that disagree among themselves so the sender is
  ambiguous. A SKIP is never turned into an abort: this guard must not fail requests the bytes do not
  condemn.

A prefill that publishes digests but whose digest for the room does not reach decode within the wait, or that
says its digest failed, leaves the guard unable to decide: that is an ABORT (fail closed), not a SKIP.

Agreement (:func:`agree`): the logical OR of "abort" over ranks, with a missing rank = abort. In the real
integration each rank exchanges one small int per committing request over the group's CPU (gloo) group
(``compat/kv_digest.TorchGroupTransport``, an ``all_gather`` waited on with a timeout) before commit, so no rank can
generate while another aborts, and a mismatch cannot strand peers in a collective (upstream's checksum
``#39729``). :class:`QueueTransport` does the same over multiprocessing queues (tests, no torch).

Relation to upstream ``--disaggregation-enable-kv-checksum`` (0.5.21+, off by default): upstream digests
whole pages per rank with adler32 and skips when the whole-rank layout signature differs, so it cannot
compare prefill and decode of different TP widths; its rank agreement is an unbounded all-reduce. Ours is
per global KV head, token-granular and bounded, and reads only the KV data buffers (not upstream's canary
buffers), so both can run at once; with ours on, upstream's adds nothing and may stay off.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from sglang_harden.guards.base import Decision, Verdict, allow
from sglang_harden.kernels.digest_spec import SPEC_VERSION, KVLayout, ShardDigest, to_signed64

GUARD = "checksum"
ABORT_STATUS = 500

CODE_ALLOW = 0
CODE_SKIP = 1
CODE_ABORT = 2
CODE_MISSING = 3

_DTYPE_CODES: dict[str, int] = {
    "bfloat16": 1,
    "float16": 2,
    "float32": 3,
    "float8_e4m3fn": 4,
    "float8_e5m2": 5,
    "float8_e4m3fnuz": 6,
    "float8_e5m2fnuz": 7,
    "uint8": 8,
    "int8": 9,
    "float4_e2m1fn_x2": 10,
}
_WIRE_MAGIC = 0x5347_4844  # "SGHD"
_WIRE_HEADER = 12
_NOTICE_MAGIC = 0x5347_484E  # "SGHN": a prefill rank says why it publishes no digest for a room
NOTICE_NOT_DIGESTIBLE = 1  # its KV layout is one the digest does not cover: not comparable
NOTICE_FAILED = 2  # computing the digest raised: nothing vouches for the bytes


# ---------------------------------------------------------------------------------------------- compare


def _skip(rid: str, reason: str, fields: dict[str, object]) -> Decision:
    return Decision(
        GUARD, Verdict.SKIP, f"request {rid}: digest not comparable: {reason}", None, {**fields, "rid": rid}
    )


def _layout_diff(a: KVLayout, b: KVLayout) -> str:
    names = ("dtype", "head_dim", "itemsize", "num_layers", "kv_halves", "total_kv_heads")
    diffs = [f"{n} {x!r}!={y!r}" for n, x, y in zip(names, a.invariant(), b.invariant(), strict=True) if x != y]
    return ", ".join(diffs)


def _candidates(prefill: Sequence[ShardDigest], head: int) -> dict[int, list[int]]:
    """Digest value -> prefill ranks that published it, for one global head."""
    found: dict[int, list[int]] = {}
    for shard in prefill:
        value = shard.by_head().get(head)
        if value is not None:
            found.setdefault(value, []).append(shard.rank)
    return found


def compare(prefill: Sequence[ShardDigest], decode: ShardDigest, rid: str = "") -> Decision:
    """This decode rank's verdict on one request: ALLOW, ABORT (which heads) or SKIP (why not comparable)."""
    if not prefill:
        return _skip(rid, "prefill published no digest", {"decode_rank": decode.rank})
    usable = [p for p in prefill if p.layout.invariant() == decode.layout.invariant()]
    if not usable:
        return _skip(
            rid,
            f"layout differs from prefill ({_layout_diff(prefill[0].layout, decode.layout)})",
            {"decode_rank": decode.rank},
        )
    mine = set(decode.layout.heads)
    for shard in usable:
        if mine & set(shard.layout.heads) and (shard.start_token, shard.n_tokens) != (
            decode.start_token,
            decode.n_tokens,
        ):
            return _abort_range(rid, shard, decode)
    return _compare_heads(usable, decode, rid)


def _abort_range(rid: str, shard: ShardDigest, decode: ShardDigest) -> Decision:
    reason = (
        f"request {rid}: prefill rank {shard.rank} vouched for KV of tokens [{shard.start_token}, "
        f"{shard.start_token + shard.n_tokens}) but decode rank {decode.rank} is about to read "
        f"[{decode.start_token}, {decode.start_token + decode.n_tokens})"
    )
    fields = {
        "rid": rid,
        "prefill_rank": shard.rank,
        "decode_rank": decode.rank,
        "sent_tokens": shard.n_tokens,
        "read_tokens": decode.n_tokens,
    }
    return Decision(GUARD, Verdict.ABORT, reason, ABORT_STATUS, fields)


def _compare_heads(usable: Sequence[ShardDigest], decode: ShardDigest, rid: str) -> Decision:
    verified: list[int] = []
    mismatched: list[tuple[int, list[int]]] = []
    unpublished: list[int] = []
    ambiguous: list[int] = []
    for head, value in decode.by_head().items():
        found = _candidates(usable, head)
        if value in found:
            verified.append(head)
        elif not found:
            unpublished.append(head)
        elif len(found) == 1:
            mismatched.append((head, next(iter(found.values()))))
        else:
            ambiguous.append(head)
    fields = {"rid": rid, "decode_rank": decode.rank, "tokens": decode.n_tokens, "verified_heads": verified}
    if mismatched:
        heads = [h for h, _ in mismatched]
        ranks = sorted({r for _, rs in mismatched for r in rs})
        reason = (
            f"request {rid}: KV digest mismatch on decode rank {decode.rank} for KV heads {heads} "
            f"(prefill rank(s) {ranks}, {decode.n_tokens} tokens): the received pages are not what prefill sent"
        )
        return Decision(
            GUARD, Verdict.ABORT, reason, ABORT_STATUS, {**fields, "mismatched_heads": heads, "prefill_ranks": ranks}
        )
    if unpublished:
        reason = f"prefill published no digest for KV heads {unpublished}"
        return _skip(rid, reason, {**fields, "unpublished_heads": unpublished})
    if ambiguous:
        reason = f"replicas of KV heads {ambiguous} disagree on prefill, sender ambiguous"
        return _skip(rid, reason, {**fields, "ambiguous_heads": ambiguous})
    return allow(GUARD, **fields)


# ------------------------------------------------------------------------------------------------ agree


def outcome_code(decision: Decision | None) -> int:
    if decision is None:
        return CODE_MISSING
    return {Verdict.ALLOW: CODE_ALLOW, Verdict.SKIP: CODE_SKIP}.get(decision.verdict, CODE_ABORT)


def decision_from_code(code: int | None, rank: int, rid: str = "") -> Decision | None:
    """A placeholder for a peer's outcome known only by its code (the peer logs its own details)."""
    fields = {"rid": rid, "rank": rank}
    if code is None or code == CODE_MISSING:
        return None
    if code == CODE_ALLOW:
        return allow(GUARD, **fields)
    if code == CODE_SKIP:
        return Decision(GUARD, Verdict.SKIP, f"rank {rank}: not comparable", None, fields)
    return Decision(GUARD, Verdict.ABORT, f"rank {rank} found a KV digest mismatch", ABORT_STATUS, fields)


def agree(outcomes: Sequence[Decision | None], rid: str = "") -> Decision:
    """One outcome for all ranks: any abort or missing rank -> ABORT; all skipped -> SKIP; else ALLOW."""
    missing = [r for r, d in enumerate(outcomes) if d is None]
    aborting = [
        r
        for r, d in enumerate(outcomes)
        if d is not None and d.verdict is not Verdict.ALLOW and d.verdict is not Verdict.SKIP
    ]
    skipped = [r for r, d in enumerate(outcomes) if d is not None and d.verdict is Verdict.SKIP]
    fields = {
        "rid": rid,
        "ranks": len(outcomes),
        "aborting_ranks": aborting,
        "missing_ranks": missing,
        "skipped_ranks": skipped,
    }
    if aborting:
        first = outcomes[aborting[0]]
        assert first is not None
        reason = f"request {rid}: aborted on all ranks because rank(s) {aborting} aborted: {first.reason}"
        return Decision(GUARD, Verdict.ABORT, reason, ABORT_STATUS, {**first.fields, **fields})
    if missing or not outcomes:
        reason = f"request {rid}: rank(s) {missing} did not report a digest outcome in time; aborting on all"
        return Decision(GUARD, Verdict.ABORT, reason, ABORT_STATUS, fields)
    if len(skipped) == len(outcomes):
        first = outcomes[0]
        assert first is not None
        return Decision(GUARD, Verdict.SKIP, first.reason, None, {**first.fields, **fields})
    return allow(GUARD, **fields)


class OutcomeTransport(Protocol):
    """Exchanges every rank's codes for the same list of requests, within a time bound."""

    rank: int
    world_size: int

    def exchange(self, codes: list[int], timeout_s: float) -> list[list[int] | None]:
        """Codes of every rank (index = rank); ``None`` for a rank whose codes did not arrive in time."""
        ...


def agree_across_ranks(
    local: Sequence[Decision], transport: OutcomeTransport, timeout_s: float, rids: Sequence[str] = ()
) -> list[Decision]:
    """Exchange this rank's outcomes for a batch of requests and return the agreed outcome for each."""
    codes = [outcome_code(d) for d in local]
    try:
        gathered = transport.exchange(codes, timeout_s)
    except Exception:  # noqa: BLE001 - a broken group is a missing peer: abort, never raise into the scheduler
        gathered = [codes if r == transport.rank else None for r in range(transport.world_size)]
    names = list(rids) or [str(d.fields.get("rid", "")) for d in local]
    agreed: list[Decision] = []
    for i, mine in enumerate(local):
        per_rank: list[Decision | None] = []
        for rank, peer in enumerate(gathered):
            if rank == transport.rank:
                per_rank.append(mine)
            else:
                code = peer[i] if peer is not None and i < len(peer) else None
                per_rank.append(decision_from_code(code, rank, names[i]))
        agreed.append(agree(per_rank, names[i]))
    return agreed


class QueueTransport:
    """The same exchange over multiprocessing queues: ``inboxes[r]`` is rank r's queue."""

    def __init__(self, rank: int, inboxes: Sequence[Any]) -> None:
        self.rank = rank
        self.world_size = len(inboxes)
        self._inboxes = inboxes
        self._round = 0
        self._early: dict[tuple[int, int], list[int]] = {}

    def exchange(self, codes: list[int], timeout_s: float) -> list[list[int] | None]:
        import queue

        self._round += 1
        for rank, box in enumerate(self._inboxes):
            if rank != self.rank:
                box.put((self._round, self.rank, list(codes)))
        got: dict[int, list[int]] = {self.rank: list(codes)}
        for rank in range(self.world_size):
            early = self._early.pop((self._round, rank), None)
            if early is not None:
                got[rank] = early
        deadline = time.monotonic() + timeout_s
        while len(got) < self.world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rnd, rank, peer_codes = self._inboxes[self.rank].get(timeout=left)
            except queue.Empty:
                break
            if rnd == self._round:
                got[rank] = peer_codes
            elif rnd > self._round:
                self._early[(rnd, rank)] = peer_codes
        return [got.get(r) for r in range(self.world_size)]


# ------------------------------------------------------------------------------------------------- wire


def pack_shard(shard: ShardDigest) -> list[int]:
    """``shard`` as signed int64 values (for an int64 metadata slot or a side channel)."""
    lay = shard.layout
    header = [
        (_WIRE_MAGIC << 16) | SPEC_VERSION,
        _DTYPE_CODES.get(lay.dtype, 0),
        lay.head_dim,
        lay.itemsize,
        lay.num_layers,
        lay.kv_halves | (int(lay.replicated) << 8),
        lay.total_kv_heads,
        lay.head_start,
        lay.num_heads,
        lay.page_size,
        shard.start_token,
        shard.n_tokens | (shard.rank << 40),
    ]
    return header + [to_signed64(d) for d in shard.digests]


def pack_notice(rank: int, code: int) -> list[int]:
    """A prefill rank's "no digest for this room, because ``code``" (same channel as a packed shard)."""
    return [(_NOTICE_MAGIC << 16) | SPEC_VERSION, code, rank]


def unpack_notice(values: Sequence[int]) -> tuple[int, int] | None:
    """``(rank, code)`` of a notice, ``None`` when ``values`` is not one."""
    if len(values) != 3 or values[0] != (_NOTICE_MAGIC << 16) | SPEC_VERSION:
        return None
    return int(values[2]), int(values[1])


def unpack_shard(values: Sequence[int]) -> ShardDigest | None:
    """Inverse of :func:`pack_shard`; ``None`` when ``values`` is not a digest of this spec version."""
    if len(values) < _WIRE_HEADER or values[0] != (_WIRE_MAGIC << 16) | SPEC_VERSION:
        return None
    names = {code: name for name, code in _DTYPE_CODES.items()}
    (_, dtype, head_dim, itemsize, layers, halves, total, start, heads, page, first, count) = (
        int(v) for v in values[:_WIRE_HEADER]
    )
    digests = tuple(int(v) & ((1 << 64) - 1) for v in values[_WIRE_HEADER : _WIRE_HEADER + heads])
    if len(digests) != heads:
        return None
    layout = KVLayout(
        names.get(dtype, f"unknown-{dtype}"),
        head_dim,
        itemsize,
        layers,
        halves & 0xFF,
        total,
        start,
        heads,
        page,
        bool(halves >> 8),
    )
    return ShardDigest(layout, first, count & ((1 << 40) - 1), digests, count >> 40)


# ---- what decode decides on prefill's answer (the plugin's kv_digest and the backport's pd_digest)


def notices_in(shards: dict[int, tuple[int, ...]]) -> dict[int, int]:
    """Prefill ranks that said why they publish no digest for this room: ``{rank: code}``."""
    found = (unpack_notice(values) for values in shards.values())
    return {rank: code for rank, code in (n for n in found if n is not None)}


def decide_on_notices(rid: str, notices: dict[int, int]) -> Decision:
    failed = sorted(rank for rank, code in notices.items() if code != NOTICE_NOT_DIGESTIBLE)
    if failed:
        return unverifiable(rid, f"prefill rank(s) {failed} failed to digest the KV they sent (see their log)")
    return not_comparable(rid, f"prefill rank(s) {sorted(notices)} cannot digest their KV layout (see their log)")


def unverifiable(rid: str, reason: str) -> Decision:
    message = f"request {rid}: KV digest could not be verified ({reason}); refusing to decode unverified pages"
    return Decision(GUARD, Verdict.ABORT, message, ABORT_STATUS, {"rid": rid})


def not_comparable(rid: str, reason: str) -> Decision:
    return Decision(GUARD, Verdict.SKIP, f"request {rid}: digest not comparable: {reason}", None, {"rid": rid})


def published_shards(shards: dict[int, tuple[int, ...]]) -> list[ShardDigest]:
    """The published shards of this spec version (anything else is ignored)."""
    return [s for s in (unpack_shard(v) for v in shards.values()) if s is not None]
