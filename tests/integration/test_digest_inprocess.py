"""The checksum hooks' KV side on SGLang's real ``MHATokenToKVPool`` (CPU), in one process: run under a pin venv.

Prefill and decode each get a real pool; "the transfer" copies the request's rows from prefill's slots to
decode's (different) slots, as the KV transfer does. The schedulers are stand-ins holding what
``compat.kv_digest`` reads from a scheduler (the pool, ``req_to_token``, the TP coordinates, the model's KV
head count), because a real scheduler needs a model. Asserted: a faithful copy compares equal, at the same and
at different TP widths (prefill TP 1, decode TP 2 as two pools of one head each); a flipped bit, a row the
copy skipped and a short send are each an abort. What prefill posts (its shard, or a notice of why it has none)
and what decode decides on each answer of the side channel (verified, skipped, refused) are checked on the same
pools.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

from sglang_harden.compat import digest_pool, kv_digest  # noqa: E402
from sglang_harden.guards import checksum  # noqa: E402
from sglang_harden.guards.base import Verdict  # noqa: E402

SIZE, HEADS, DIM, LAYERS = 64, 2, 16, 3
N_TOKENS = 20
PREFILL_SLOTS = list(range(3, 3 + N_TOKENS))
DECODE_SLOTS = list(range(40, 40 + N_TOKENS))[::-1]  # any order: the digest follows token positions


def _pool(heads: int = HEADS) -> Any:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(SIZE, 1, torch.bfloat16, heads, DIM, LAYERS, "cpu", False)


def _scheduler(pool: Any, slots: list[int], rank: int = 0, size: int = 1) -> Any:
    req_to_token = torch.zeros((2, SIZE), dtype=torch.int32)
    req_to_token[1, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
    return SimpleNamespace(
        token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: pool),
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        model_config=SimpleNamespace(get_total_num_kv_heads=lambda: HEADS),
        ps=SimpleNamespace(attn_tp_rank=rank, attn_tp_size=size),  # where 0.5.19 and 0.5.20 keep them
    )


def _filled_prefill() -> Any:
    pool = _pool()
    gen = torch.Generator().manual_seed(5)
    for buffers in (pool.k_buffer, pool.v_buffer):
        for layer in buffers:
            layer.copy_(torch.randn(layer.shape, generator=gen).to(layer.dtype))
    return pool


def _transfer(src: Any, dst: Any, heads: slice = slice(None), skip: int | None = None) -> None:
    for src_bufs, dst_bufs in ((src.k_buffer, dst.k_buffer), (src.v_buffer, dst.v_buffer)):
        for s, d in zip(src_bufs, dst_bufs, strict=True):
            for i, (a, b) in enumerate(zip(PREFILL_SLOTS, DECODE_SLOTS, strict=True)):
                if i != skip:
                    d[b] = s[a, heads]


def _prefill_shard(pool: Any, end: int = N_TOKENS) -> Any:
    shard, reason = kv_digest.digest_rows(_scheduler(pool, PREFILL_SLOTS), 1, 0, end)
    assert shard is not None, reason
    return shard


def _decode_verdict(prefill_shard: Any, pool: Any, rank: int = 0, size: int = 1) -> Verdict:
    shard, reason = kv_digest.digest_rows(_scheduler(pool, DECODE_SLOTS, rank, size), 1, 0, N_TOKENS)
    assert shard is not None, reason
    return checksum.compare([prefill_shard], shard, "r").verdict


def test_real_pool_layout_is_read() -> None:
    layout, k, v, reason = kv_digest.pool_layout(_scheduler(_pool(), PREFILL_SLOTS))
    assert layout is not None, reason
    assert (layout.dtype, layout.head_dim, layout.itemsize, layout.num_layers) == ("bfloat16", DIM, 2, LAYERS)
    assert (layout.kv_halves, layout.total_kv_heads, layout.heads) == (2, HEADS, range(0, HEADS))
    assert len(k) == len(v or []) == LAYERS


def test_attention_tp_position_is_read_where_the_pin_keeps_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode rank that mislabels its heads compares them with the wrong prefill heads (a false abort found
    on a real --tp 2 decode): the position comes from the scheduler, its ``ps`` or ``get_parallel()``, and a
    rank that holds a share of the heads without saying where is not comparable, never guessed as rank 0."""
    pool = _pool(HEADS // 2)
    plain = SimpleNamespace(attn_tp_rank=1, attn_tp_size=2)
    assert kv_digest._tp_coordinates(SimpleNamespace(ps=plain)) == (1, 2)
    assert kv_digest._tp_coordinates(plain) == (1, 2)
    layout = kv_digest.pool_layout(_scheduler(pool, [], rank=1, size=2))[0]
    assert layout is not None and list(layout.heads) == list(range(HEADS // 2, HEADS))
    monkeypatch.setattr(digest_pool, "_parallel_context", lambda: None)  # as in a process that never set it up
    unknown = _scheduler(pool, [], rank=1, size=2)
    del unknown.ps
    layout, _, _, reason = kv_digest.pool_layout(unknown)
    assert layout is None and "attention TP rank is unknown" in reason
    full = _scheduler(_pool(), [], rank=0, size=1)
    del full.ps
    layout = kv_digest.pool_layout(full)[0]  # all heads here: no position needed
    assert layout is not None and list(layout.heads) == list(range(HEADS))
    monkeypatch.setattr(digest_pool, "_parallel_context", lambda: plain)  # 0.5.21+: runtime_context
    assert kv_digest._tp_coordinates(unknown) == (1, 2)


def test_faithful_transfer_compares_equal() -> None:
    prefill, decode = _filled_prefill(), _pool()
    _transfer(prefill, decode)
    assert _decode_verdict(_prefill_shard(prefill), decode) is Verdict.ALLOW


def test_different_tp_widths_compare_per_head() -> None:
    prefill = _filled_prefill()
    shard = _prefill_shard(prefill)
    for rank in range(HEADS):
        decode = _pool(heads=1)
        _transfer(prefill, decode, heads=slice(rank, rank + 1))
        assert _decode_verdict(shard, decode, rank=rank, size=HEADS) is Verdict.ALLOW


def test_flipped_bit_aborts() -> None:
    prefill, decode = _filled_prefill(), _pool()
    _transfer(prefill, decode)
    decode.v_buffer[LAYERS - 1][DECODE_SLOTS[7]].view(torch.uint8).reshape(-1)[5] ^= 0x10
    assert _decode_verdict(_prefill_shard(prefill), decode) is Verdict.ABORT


def test_row_never_written_aborts() -> None:
    prefill, decode = _filled_prefill(), _pool()
    _transfer(prefill, decode, skip=N_TOKENS - 1)
    assert _decode_verdict(_prefill_shard(prefill), decode) is Verdict.ABORT


def test_short_send_aborts() -> None:
    prefill, decode = _filled_prefill(), _pool()
    _transfer(prefill, decode)
    assert _decode_verdict(_prefill_shard(prefill, end=N_TOKENS - 4), decode) is Verdict.ABORT


def test_published_shard_survives_the_wire() -> None:
    shard = _prefill_shard(_filled_prefill())
    assert checksum.unpack_shard(checksum.pack_shard(shard)) == shard


# ------------------------------------------------- what prefill publishes, and what decode does with it


class _Board:
    """Stands in for the digest publisher (its HTTP side is tested in tests/unit/test_digest_channel.py)."""

    def __init__(self) -> None:
        self.posted: list[Any] = []

    def publish(self, shard: Any) -> bool:
        self.posted.append(shard)
        return True

    def publish_when_ready(self, make: Any) -> None:
        self.posted.append(make())  # the publisher's thread would make it; here, at once


def _reader(sent_range: Any = lambda scheduler, req, end_idx: (0, N_TOKENS)) -> Any:
    return kv_digest.DigestReader(
        pool_row=lambda req: 1, sent_range=sent_range, is_fake_transfer=lambda req: False,
        abort_transferred=lambda queue, decode_req, decision: None,
    )


def _published(monkeypatch: pytest.MonkeyPatch, pool: Any, reader: Any) -> Any:
    from sglang_harden.compat.runtime import RUNTIME

    board = _Board()
    monkeypatch.setattr(RUNTIME, "digest_publisher", board)
    kv_digest._publish(_scheduler(pool, PREFILL_SLOTS), SimpleNamespace(rid="p", bootstrap_room=11), reader, None)
    assert len(board.posted) == 1 and board.posted[0].room == 11
    return board.posted[0]


def test_prefill_publishes_its_shard(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = _filled_prefill()
    posted = _published(monkeypatch, pool, _reader())
    assert checksum.unpack_shard(posted.values) == _prefill_shard(pool)


def test_prefill_that_cannot_digest_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode must not wait out its bound for a digest that will never come: prefill posts a notice instead."""
    hnd = _filled_prefill()
    hnd.use_hnd = True
    assert checksum.unpack_notice(_published(monkeypatch, hnd, _reader()).values) == (
        0, checksum.NOTICE_NOT_DIGESTIBLE)

    def broken(scheduler: Any, req: Any, end_idx: Any) -> tuple[int, int]:
        raise RuntimeError("sent range unknown")

    failed = _published(monkeypatch, _filled_prefill(), _reader(broken))
    assert checksum.unpack_notice(failed.values) == (0, checksum.NOTICE_FAILED)


def _decide_on(monkeypatch: pytest.MonkeyPatch, fetched: Any, decode_pool: Any = None) -> Any:
    """Decode's decision (the commit gate's checksum step) for a request whose prefill answered ``fetched`` (the
    side channel replaced)."""
    import time

    from sglang_harden.compat import digest_channel

    monkeypatch.setattr(digest_channel, "receive_digests", lambda feed, addr, room, wait_s, enough: fetched)
    pool = decode_pool if decode_pool is not None else _pool()
    req = SimpleNamespace(rid="d", bootstrap_room=11, origin_input_ids=list(range(N_TOKENS)))
    decode_req = SimpleNamespace(req=req, kv_receiver=SimpleNamespace(bootstrap_addr="127.0.0.1:1"))
    queue = SimpleNamespace(scheduler=_scheduler(pool, DECODE_SLOTS))
    step = kv_digest.checksum_step(_reader())
    pending = step.launch(queue, decode_req)
    deadline = time.monotonic() + 10
    while (decision := step.decide(queue, decode_req, pending)) is None:
        assert time.monotonic() < deadline, "the checksum step never decided"
        time.sleep(0.001)
    return decision


def test_decode_decides_on_what_prefill_published(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_harden.compat.digest_channel import Fetched

    prefill, decode = _filled_prefill(), _pool()
    _transfer(prefill, decode)
    shard = {0: tuple(checksum.pack_shard(_prefill_shard(prefill)))}
    assert _decide_on(monkeypatch, Fetched(shard), decode).verdict is Verdict.ALLOW
    not_hardened = Fetched({}, "prefill's bootstrap server has no digest route (prefill not hardened)")
    assert _decide_on(monkeypatch, not_hardened).verdict is Verdict.SKIP
    layout_notice = Fetched({0: tuple(checksum.pack_notice(0, checksum.NOTICE_NOT_DIGESTIBLE))})
    skipped = _decide_on(monkeypatch, layout_notice)
    assert skipped.verdict is Verdict.SKIP and "cannot digest their KV layout" in skipped.reason


def test_decode_refuses_what_it_cannot_verify(monkeypatch: pytest.MonkeyPatch) -> None:
    """A publishing prefill whose digest did not arrive in time, or whose digest failed, leaves the guard unable
    to decide: the request is refused (before, a late digest was a skip and the request was served unchecked)."""
    from sglang_harden.compat.digest_channel import Fetched

    late = _decide_on(monkeypatch, Fetched({}, "prefill published no digest for room 11 within 5.0 s", True))
    assert late.verdict is Verdict.ABORT and "could not be verified" in late.reason and "within 5.0 s" in late.reason
    prefill = _filled_prefill()
    half = Fetched({0: tuple(checksum.pack_shard(_prefill_shard(prefill)))[:-1]}, "not every rank", True)
    assert _decide_on(monkeypatch, half).verdict is Verdict.ABORT
    failed = _decide_on(monkeypatch, Fetched({0: tuple(checksum.pack_notice(0, checksum.NOTICE_FAILED))}))
    assert failed.verdict is Verdict.ABORT and "failed to digest" in failed.reason


# ------------------------------------------------------------------------------------------------ canary


def _canary_commit(pool: Any, room: int, written: list[int], pages: list[int]) -> Any:
    """Stamp ``pages`` through the real ``send_metadata`` wrapper, "transfer" into ``written``, then commit."""
    import numpy as np

    from sglang_harden.compat import kv_canary
    from sglang_harden.compat.runtime import RUNTIME

    RUNTIME.decode_kv_pool = pool
    sent: list[Any] = []
    send = kv_canary.stamp_before_send(lambda self, kv_indices, *a, **k: sent.append(kv_indices))
    send(SimpleNamespace(bootstrap_room=room), np.array(pages, dtype=np.int32), 0)
    source = _filled_prefill()
    for page in written:
        for src, dst in ((source.k_buffer, pool.k_buffer), (source.v_buffer, pool.v_buffer)):
            for s, d in zip(src, dst, strict=True):
                d[page] = s[page]
    step = kv_canary.canary_step()
    decode_req = SimpleNamespace(req=SimpleNamespace(rid=f"canary-{room}", bootstrap_room=room))
    decision = step.decide(None, decode_req, step.launch(None, decode_req))
    assert decision is not None, "on the CPU the check lands at once"
    aborted = [] if decision.allows else [decision]
    return ("committed" if decision.allows else None), aborted, sent


def test_canary_passes_a_fully_written_transfer() -> None:
    pages = list(range(10, 18))
    result, aborted, sent = _canary_commit(_pool(), 501, pages, pages)
    assert result == "committed" and not aborted and list(sent[0]) == pages


def test_canary_catches_a_page_the_transfer_skipped() -> None:
    pages = list(range(10, 18))
    result, aborted, _ = _canary_commit(_pool(), 502, pages[:-1], pages)
    assert result is None and aborted and aborted[0].verdict is Verdict.ABORT
    assert aborted[0].fields["unwritten_pages"] == [17]
