"""Checksum guard decisions: compare (per head, across TP widths), agree (OR of abort, missing = abort), wire."""

from __future__ import annotations

import queue
import threading

import numpy as np
import pytest

from sglang_harden.guards.base import Decision, Verdict
from sglang_harden.guards.checksum import (
    CODE_ABORT,
    CODE_MISSING,
    QueueTransport,
    agree,
    agree_across_ranks,
    compare,
    decision_from_code,
    outcome_code,
    pack_shard,
    unpack_shard,
)
from sglang_harden.kernels.digest_ref import digest_numpy
from sglang_harden.kernels.digest_spec import KVLayout, ShardDigest, token_slots

TOTAL = 8


def layout(start: int = 0, heads: int = TOTAL, **over: object) -> KVLayout:
    base = dict(
        dtype="bfloat16",
        head_dim=16,
        itemsize=2,
        num_layers=2,
        kv_halves=2,
        total_kv_heads=TOTAL,
        head_start=start,
        num_heads=heads,
        page_size=4,
    )
    base.update(over)
    return KVLayout(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def kv() -> tuple[list[np.ndarray], list[np.ndarray], list[int]]:
    rng = np.random.default_rng(3)
    shape = (40, TOTAL, 16)
    k = [rng.integers(0, 2**16, shape, dtype=np.uint16) for _ in range(2)]
    v = [rng.integers(0, 2**16, shape, dtype=np.uint16) for _ in range(2)]
    return k, v, token_slots([2, 7, 0], 4, 11)


def shard(
    kv: tuple,
    start: int,
    heads: int,
    rank: int,
    slots: list[int] | None = None,
    flip: tuple[int, int] | None = None,
    **over: object,
) -> ShardDigest:
    k, v, default_slots = kv
    slots = default_slots if slots is None else slots
    ks = [b[:, start : start + heads].copy() for b in k]
    vs = [b[:, start : start + heads].copy() for b in v]
    if flip is not None:  # (slot, local head)
        ks[1][flip[0], flip[1], 0] ^= 0x4000
    lay = layout(start, heads, **over)
    return ShardDigest(lay, 0, len(slots), digest_numpy(ks, vs, slots, lay), rank)


def prefill_tp(kv: tuple, tp: int) -> list[ShardDigest]:
    per = TOTAL // tp
    return [shard(kv, r * per, per, r) for r in range(tp)]


@pytest.mark.parametrize(("prefill_width", "decode_width"), [(1, 1), (1, 4), (2, 4), (4, 2), (8, 1), (2, 8)])
def test_clean_transfer_is_allowed_for_any_tp_pair(kv, prefill_width: int, decode_width: int) -> None:
    prefill = prefill_tp(kv, prefill_width)
    per = TOTAL // decode_width
    for rank in range(decode_width):
        decision = compare(prefill, shard(kv, rank * per, per, rank), rid="r")
        assert decision.verdict is Verdict.ALLOW, decision.reason
        assert decision.fields["verified_heads"] == list(range(rank * per, rank * per + per))


def test_flipped_bit_aborts_naming_head_and_prefill_rank(kv) -> None:
    prefill = prefill_tp(kv, 2)  # prefill ranks hold heads 0-3, 4-7
    decode = shard(kv, 4, 2, rank=2, flip=(kv[2][5], 1))  # decode rank 2 holds heads 4-5; head 5 corrupt
    decision = compare(prefill, decode, rid="r")
    assert decision.verdict is Verdict.ABORT and decision.status_code == 500
    assert decision.fields["mismatched_heads"] == [5] and decision.fields["prefill_ranks"] == [1]
    assert "KV heads [5]" in decision.reason


def test_stale_page_aborts(kv) -> None:
    prefill = prefill_tp(kv, 1)
    k, v, slots = kv
    stale = token_slots([2, 9, 0], 4, 11)  # decode's second page never got this request's KV
    decision = compare(prefill, shard(kv, 0, TOTAL, 0, slots=stale), rid="r")
    assert decision.verdict is Verdict.ABORT
    assert decision.fields["mismatched_heads"] == list(range(TOTAL))


def test_short_send_aborts_on_token_range(kv) -> None:
    k, v, slots = kv
    prefill = [shard(kv, 0, TOTAL, 0, slots=slots[:7])]
    decision = compare(prefill, shard(kv, 0, TOTAL, 0), rid="r")
    assert decision.verdict is Verdict.ABORT
    assert decision.fields["sent_tokens"] == 7 and decision.fields["read_tokens"] == 11


@pytest.mark.parametrize(
    ("over", "word"),
    [({"dtype": "float16"}, "dtype"), ({"num_layers": 3}, "num_layers"), ({"total_kv_heads": 16}, "total_kv_heads")],
)
def test_different_layout_is_skipped_not_aborted(kv, over: dict, word: str) -> None:
    prefill = [ShardDigest(layout(0, TOTAL, **over), 0, 11, (1,) * TOTAL, 0)]
    decision = compare(prefill, shard(kv, 0, TOTAL, 0), rid="r")
    assert decision.verdict is Verdict.SKIP and decision.allows
    assert word in decision.reason


def test_missing_prefill_shard_or_digest_is_skipped(kv) -> None:
    assert compare([], shard(kv, 0, 4, 0), rid="r").verdict is Verdict.SKIP
    decision = compare(prefill_tp(kv, 2)[:1], shard(kv, 2, 4, 1), rid="r")  # heads 4-5 never published
    assert decision.verdict is Verdict.SKIP
    assert decision.fields["unpublished_heads"] == [4, 5] and decision.fields["verified_heads"] == [2, 3]


def test_replicated_head_compares_against_agreeing_replicas(kv) -> None:
    # MLA-like: one latent head, every prefill rank holds it
    mla = {"kv_halves": 2, "total_kv_heads": 1, "replicated": True}
    k, v, slots = kv
    lay = layout(0, 1, **mla)
    good = digest_numpy([b[:, :1] for b in k], [b[:, :1] for b in v], slots, lay)
    replicas = [ShardDigest(lay, 0, 11, good, r) for r in range(4)]
    assert compare(replicas, ShardDigest(lay, 0, 11, good, 0), "r").verdict is Verdict.ALLOW
    bad = ((good[0] ^ 1),)
    assert compare(replicas, ShardDigest(lay, 0, 11, bad, 0), "r").verdict is Verdict.ABORT
    split = replicas[:2] + [ShardDigest(lay, 0, 11, (12345,), 2)]
    assert compare(split, ShardDigest(lay, 0, 11, good, 0), "r").verdict is Verdict.ALLOW  # matches a replica
    decision = compare(split, ShardDigest(lay, 0, 11, bad, 0), "r")
    assert decision.verdict is Verdict.SKIP and "ambiguous" in decision.reason


def d(verdict: Verdict) -> Decision:
    return Decision("checksum", verdict, verdict.value)


def test_agree_is_or_of_abort_and_missing_is_abort() -> None:
    assert agree([d(Verdict.ALLOW)] * 4).verdict is Verdict.ALLOW
    assert agree([d(Verdict.ALLOW), d(Verdict.SKIP)]).verdict is Verdict.ALLOW
    assert agree([d(Verdict.SKIP)] * 3).verdict is Verdict.SKIP
    aborted = agree([d(Verdict.ALLOW), d(Verdict.ABORT), d(Verdict.SKIP)])
    assert aborted.verdict is Verdict.ABORT and aborted.fields["aborting_ranks"] == [1]
    missing = agree([d(Verdict.ALLOW), None, d(Verdict.ALLOW)])
    assert missing.verdict is Verdict.ABORT and missing.fields["missing_ranks"] == [1]
    assert agree([]).verdict is Verdict.ABORT


def test_codes_round_trip() -> None:
    for verdict in (Verdict.ALLOW, Verdict.SKIP, Verdict.ABORT):
        back = decision_from_code(outcome_code(d(verdict)), rank=2)
        assert back is not None and back.verdict is verdict
    assert outcome_code(None) == CODE_MISSING and decision_from_code(CODE_MISSING, 0) is None
    assert outcome_code(d(Verdict.REJECT)) == CODE_ABORT


def _agree_in_threads(world: int, local: list[list[Decision]], absent: set[int], timeout: float) -> dict:
    # thread queues, not multiprocessing ones: no feeder thread to starve on a loaded CI machine (the
    # cross-process case is tests/integration/test_digest_agreement.py)
    boxes = [queue.Queue() for _ in range(world)]
    out: dict[int, list[Decision]] = {}

    def run(rank: int) -> None:
        out[rank] = agree_across_ranks(local[rank], QueueTransport(rank, boxes), timeout)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world) if r not in absent]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    return out


def test_agree_across_ranks_over_queues_batches_requests() -> None:
    ok, bad = d(Verdict.ALLOW), d(Verdict.ABORT)
    # a generous bound: the exchange returns as soon as every peer has answered, so it costs nothing here
    out = _agree_in_threads(3, [[ok, ok], [ok, bad], [ok, ok]], set(), 30.0)
    assert {r: [x.verdict for x in v] for r, v in out.items()} == {r: [Verdict.ALLOW, Verdict.ABORT] for r in range(3)}


def test_agree_across_ranks_missing_peer_aborts_in_bounded_time() -> None:
    import time

    ok = d(Verdict.ALLOW)
    start = time.monotonic()
    out = _agree_in_threads(3, [[ok]] * 3, {2}, 0.5)
    assert time.monotonic() - start < 3
    assert [out[r][0].verdict for r in (0, 1)] == [Verdict.ABORT, Verdict.ABORT]
    assert out[0][0].fields["missing_ranks"] == [2]


class Broken:
    rank = 0
    world_size = 2

    def exchange(self, codes: list[int], timeout_s: float) -> list:
        raise RuntimeError("group gone")


def test_broken_transport_aborts_instead_of_raising() -> None:
    assert agree_across_ranks([d(Verdict.ALLOW)], Broken(), 1.0)[0].verdict is Verdict.ABORT


def test_wire_round_trip(kv) -> None:
    sd = shard(kv, 2, 4, rank=3)
    packed = pack_shard(sd)
    assert all(-(2**63) <= x < 2**63 for x in packed)
    assert unpack_shard(packed) == sd
    assert unpack_shard([0] * 20) is None
    assert unpack_shard(packed[:-1]) is None
