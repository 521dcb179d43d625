"""The digest definition: pure Python vs numpy reference, and the properties the guard relies on."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_harden.kernels.digest_ref import digest_numpy
from sglang_harden.kernels.digest_spec import (
    KVLayout,
    check_layout,
    digest_rows_py,
    mix64,
    multipliers,
    token_slots,
)

DTYPES = {"bfloat16": np.uint16, "float16": np.float16, "float8_e4m3fn": np.uint8, "float32": np.float32}


def make_layout(
    dtype: str = "bfloat16",
    head_dim: int = 8,
    layers: int = 2,
    halves: int = 2,
    total: int = 4,
    start: int = 0,
    heads: int = 4,
    page: int = 4,
) -> KVLayout:
    return KVLayout(dtype, head_dim, np.dtype(DTYPES[dtype]).itemsize, layers, halves, total, start, heads, page)


def make_pool(rng: np.random.Generator, layout: KVLayout, slots: int) -> tuple[list, list | None]:
    shape = (slots, layout.num_heads, layout.head_dim)
    np_dtype = DTYPES[layout.dtype]

    def one() -> np.ndarray:
        return rng.integers(0, 256, size=(*shape[:2], layout.row_bytes), dtype=np.uint8).view(np_dtype)

    k = [one() for _ in range(layout.num_layers)]
    v = [one() for _ in range(layout.num_layers)] if layout.kv_halves == 2 else None
    return k, v


def rows_of(k: list, v: list | None, slots: list[int]) -> list:
    halves = [b for pair in zip(k, v, strict=True) for b in pair] if v is not None else k
    return [[[buf[s, h].tobytes() for h in range(buf.shape[1])] for s in slots] for buf in halves]


def test_mix64_is_splitmix64_finaliser() -> None:
    # first output of the reference SplitMix64 generator seeded with 0
    assert mix64(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF
    assert mix64(0) == 0


def test_multipliers_are_fixed_and_odd() -> None:
    m = multipliers(300)
    assert all(x & 1 and 0 < x < 1 << 64 for x in m)
    assert len(set(m)) == 300
    assert multipliers(4) == m[:4]


def test_token_slots_walks_pages_in_send_order() -> None:
    assert token_slots([5, 2, 9], 4, 10) == [20, 21, 22, 23, 8, 9, 10, 11, 36, 37]
    assert token_slots([5, 2], 4, 3, first_offset=2) == [22, 23, 8]
    assert token_slots([7], 1, 1) == [7]
    assert token_slots([], 4, 0) == []
    with pytest.raises(ValueError):
        token_slots([1], 4, 5)


def test_layout_checks() -> None:
    with pytest.raises(ValueError):
        check_layout(make_layout(dtype="float8_e4m3fn", head_dim=6))
    with pytest.raises(ValueError):
        check_layout(make_layout(start=2, heads=4, total=4))
    with pytest.raises(ValueError):
        check_layout(make_layout(halves=3))


@settings(max_examples=25, deadline=None)
@given(
    dtype=st.sampled_from(sorted(DTYPES)),
    halves=st.sampled_from([1, 2]),
    n=st.integers(0, 9),
    start=st.integers(0, 50),
    seed=st.integers(0, 2**32 - 1),
)
def test_numpy_matches_pure_python(dtype: str, halves: int, n: int, start: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    layout = make_layout(dtype=dtype, halves=halves, heads=2, start=1)
    k, v = make_pool(rng, layout, 24)
    slots = [int(s) for s in rng.permutation(24)[:n]]
    assert digest_numpy(k, v, slots, layout, start) == digest_rows_py(rows_of(k, v, slots), layout, start)


@pytest.fixture
def pool() -> tuple[KVLayout, list, list, list[int]]:
    rng = np.random.default_rng(7)
    layout = make_layout()
    k, v = make_pool(rng, layout, 64)
    return layout, k, v, token_slots([3, 9, 1], layout.page_size, 11)


def test_single_bit_flip_changes_only_that_head(pool) -> None:
    layout, k, v, slots = pool
    base = digest_numpy(k, v, slots, layout)
    for buf, slot, head, byte in [(k[1], slots[10], 2, 0), (v[0], slots[0], 0, 15), (k[0], slots[4], 3, 7)]:
        raw = buf.view(np.uint8).reshape(buf.shape[0], buf.shape[1], -1)
        raw[slot, head, byte] ^= 0x80
        got = digest_numpy(k, v, slots, layout)
        raw[slot, head, byte] ^= 0x80
        assert [g != b for g, b in zip(got, base, strict=True)] == [h == head for h in range(4)]


def test_order_count_and_head_identity_matter(pool) -> None:
    layout, k, v, slots = pool
    base = digest_numpy(k, v, slots, layout)
    swapped_pages = token_slots([9, 3, 1], layout.page_size, 11)
    assert all(a != b for a, b in zip(digest_numpy(k, v, swapped_pages, layout), base, strict=True))
    assert all(a != b for a, b in zip(digest_numpy(k, v, slots[:10], layout), base, strict=True))
    assert all(a != b for a, b in zip(digest_numpy(v, k, slots, layout), base, strict=True))
    assert all(a != b for a, b in zip(digest_numpy(k[::-1], v[::-1], slots, layout), base, strict=True))
    assert digest_numpy(k, v, slots, layout, start_token=1) != base
    # the same bytes under other global head numbers are different heads
    moved = KVLayout(**{**layout.__dict__, "total_kv_heads": 8, "head_start": 4})
    other_total = KVLayout(**{**layout.__dict__, "total_kv_heads": 8})
    assert set(digest_numpy(k, v, slots, moved)).isdisjoint(digest_numpy(k, v, slots, other_total))


def test_page_size_does_not_enter_the_digest(pool) -> None:
    layout, k, v, slots = pool
    page1 = KVLayout(**{**layout.__dict__, "page_size": 1})
    assert digest_numpy(k, v, slots, layout) == digest_numpy(k, v, slots, page1)


@pytest.mark.parametrize("split", [[4], [2, 2], [1, 1, 1, 1], [1, 3]])
def test_per_head_digests_compose_across_tp_widths(pool, split: list[int]) -> None:
    layout, k, v, slots = pool
    whole = digest_numpy(k, v, slots, layout)
    parts: list[int] = []
    start = 0
    for width in split:
        shard = KVLayout(**{**layout.__dict__, "head_start": start, "num_heads": width})
        parts += digest_numpy(
            [b[:, start : start + width] for b in k], [b[:, start : start + width] for b in v], slots, shard
        )
        start += width
    assert tuple(parts) == whole
