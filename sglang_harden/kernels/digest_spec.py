"""Per-KV-head digest of the KV a prefill sends for one request: the definition, in pure Python.

What is digested
----------------
Exactly the KV sent for one request, per KV-head shard: for each global KV head ``h`` this rank holds, every
layer ``l``, K then V (``s = 0, 1``; MLA pools have only the latent half, ``s = 0``), and every sent token in
send order (pages in send order, token slots inside a page in order, cut at the token count). Each
(layer, half, token, head) is one *row*: the ``head_dim * itemsize`` raw bytes of that head's vector, read as
little-endian int32 words ``x_0 .. x_{W-1}`` (``W = row_bytes / 4``; rows whose byte length is not a multiple
of 4 are not digestible, see :func:`check_layout`). The dtype only matters through its byte size: bf16, fp16,
fp8 stored as uint8 all digest their raw bits.

The hash (spec version :data:`SPEC_VERSION`; all arithmetic mod 2**64)::

    row hash     r        = sum_w  M[w] * sext64(x_w)                    # multilinear, M[w] fixed odd 64-bit
    row key      k(lh, t) = mix64(KEY_SALT ^ (lh << 40) ^ t)             # lh = 2*l + s, t = start_token + i
    head sum     S_h      = sum over (l, s, i) of mix64(r + k(lh, t))    # order-free sum: any tree/split works
    digest       D_h      = mix64(S_h + seed(layout, h, start_token, n_tokens))

``mix64`` is the SplitMix64 finaliser, ``sext64`` sign-extends an int32 to 64 bits. ``seed`` folds the spec
version, the shard-invariant layout signature (dtype name, head_dim, itemsize, layer count, halves, total KV
heads), the *global* head index, the first token position and the token count, so a digest of head 3 never
equals one of head 4, a 100-token send never equals a 99-token one, and swapping two pages or two layers
changes every affected row key.

Why this shape
--------------
* Order-sensitive: a word's multiplier depends on its position in the row; a row's key on (layer, half,
  token position); the head, token count and layout are in the seed.
* Parallel-friendly and memory-bound: every row is hashed independently with one multiply-add per 4 bytes,
  and rows are combined by a plain sum mod 2**64 (AdHash-style), so the torch path can work in cache-sized
  chunks and the Triton path reduces per block and adds partial sums in any order, bit-identically.
* Cheap detection guarantees: a change confined to one 32-bit word is always detected inside that row
  (``M[w]`` odd, the difference is below 2**32, so ``M[w] * delta != 0 mod 2**64``); rows then pass through a
  bijective mix, so the only way a changed row leaves the head sum unchanged is a coincidence of 64-bit values.
* Per head, not per rank: a decode rank holding heads ``[h0, h1)`` can compare against the per-head digests
  that prefill ranks of any TP width published for the same heads. Page size is deliberately *not* hashed
  (rows are per token), so sides with different page sizes still compare.

What it is not
--------------
An integrity check against stale, foreign, partially written or corrupted pages and against misrouted
transfers. It is **not** a cryptographic MAC: the multipliers are public and fixed, so anyone who can write KV
memory can forge a matching digest. Authentication of peers is the bootstrap guard's job.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

SPEC_VERSION = 1
MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
MULT_SALT = 0x243F6A8885A308D3  # pi
KEY_SALT = 0x13198A2E03707344
SEED_SALT = 0xA4093822299F31D0
LAYER_HALF_SHIFT = 40
MAX_TOKENS = 1 << LAYER_HALF_SHIFT


def mix64(z: int) -> int:
    """SplitMix64 finaliser: a bijection on 64-bit values."""
    z &= MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def to_signed64(value: int) -> int:
    """The int64 with the same bits as the unsigned 64-bit ``value`` (for torch/numpy int64 tensors)."""
    value &= MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


@lru_cache(maxsize=64)
def multipliers(words: int) -> tuple[int, ...]:
    """The fixed odd 64-bit multiplier ``M[w]`` for each word position of a row of ``words`` words."""
    return tuple(mix64(MULT_SALT + w * GOLDEN) | 1 for w in range(words))


def row_key(layer_half: int, token: int) -> int:
    """Key of the row at (``layer_half`` = 2*layer + half, absolute token position ``token``)."""
    return mix64(KEY_SALT ^ (layer_half << LAYER_HALF_SHIFT) ^ token)


def fold(values: Iterable[int], acc: int = SEED_SALT) -> int:
    """Fold integers into one 64-bit value, order-sensitively."""
    for v in values:
        acc = mix64(acc ^ (v & MASK64))
    return acc


@dataclass(frozen=True)
class KVLayout:
    """Layout signature of one rank's KV shard.

    ``head_dim`` is elements per row and ``itemsize`` bytes per stored element (fp8 pools stored as uint8:
    ``dtype="float8_e4m3fn", itemsize=1``). ``kv_halves`` is 2 for K+V pools and 1 for MLA latent pools.
    ``head_start``/``num_heads`` say which global KV heads this shard holds; ``replicated`` marks heads that
    other ranks hold too (MLA latent, or more TP ranks than KV heads).
    """

    dtype: str
    head_dim: int
    itemsize: int
    num_layers: int
    kv_halves: int
    total_kv_heads: int
    head_start: int
    num_heads: int
    page_size: int
    replicated: bool = False

    @property
    def row_bytes(self) -> int:
        return self.head_dim * self.itemsize

    @property
    def words_per_row(self) -> int:
        return self.row_bytes // 4

    @property
    def heads(self) -> range:
        return range(self.head_start, self.head_start + self.num_heads)

    def invariant(self) -> tuple[object, ...]:
        """The fields both sides must share to be comparable at all (no shard or page fields)."""
        return (self.dtype, self.head_dim, self.itemsize, self.num_layers, self.kv_halves, self.total_kv_heads)

    def invariant_hash(self) -> int:
        return _invariant_hash(self.invariant())


@lru_cache(maxsize=64)
def _invariant_hash(invariant: tuple[object, ...]) -> int:
    dtype, *numbers = invariant
    return fold([*_str_words(str(dtype)), *(int(x) for x in numbers)])  # type: ignore[call-overload]


@dataclass(frozen=True)
class ShardDigest:
    """What one rank publishes (prefill) or computes (decode) for one request: one digest per held head."""

    layout: KVLayout
    start_token: int
    n_tokens: int
    digests: tuple[int, ...]
    rank: int = 0

    def by_head(self) -> dict[int, int]:
        return dict(zip(self.layout.heads, self.digests, strict=True))


def _str_words(text: str) -> list[int]:
    raw = text.encode()
    return [len(raw), *raw]


def check_layout(layout: KVLayout) -> None:
    """Raise ValueError when ``layout`` cannot be digested under this spec."""
    if layout.row_bytes <= 0 or layout.row_bytes % 4:
        raise ValueError(f"row of {layout.row_bytes} bytes is not a whole number of 32-bit words")
    if layout.kv_halves not in (1, 2):
        raise ValueError(f"kv_halves must be 1 (MLA) or 2 (K and V), got {layout.kv_halves}")
    if layout.head_start < 0 or layout.head_start + layout.num_heads > layout.total_kv_heads:
        raise ValueError(f"heads [{layout.head_start}, +{layout.num_heads}) outside {layout.total_kv_heads}")
    if layout.num_layers <= 0 or layout.num_heads <= 0:
        raise ValueError("need at least one layer and one head")


def head_seed(layout: KVLayout, head: int, start_token: int, n_tokens: int) -> int:
    """``fold([SPEC_VERSION, layout hash, head, start_token, n_tokens])``, the layout prefix computed once."""
    return fold([head, start_token, n_tokens], _layout_seed(layout.invariant_hash()))


@lru_cache(maxsize=64)
def _layout_seed(invariant_hash: int) -> int:
    return fold([SPEC_VERSION, invariant_hash])


def finalize(sums: Sequence[int], layout: KVLayout, start_token: int, n_tokens: int) -> tuple[int, ...]:
    """Turn per-head sums ``S_h`` (local head order) into the published digests ``D_h``."""
    return tuple(
        mix64((s & MASK64) + head_seed(layout, head, start_token, n_tokens))
        for s, head in zip(sums, layout.heads, strict=True)
    )


def token_slots(pages: Sequence[int], page_size: int, n_tokens: int, first_offset: int = 0) -> list[int]:
    """Pool token slots of ``n_tokens`` tokens laid out over ``pages`` in send order.

    ``first_offset`` is the token offset inside the first page (0 when the sent range is page-aligned).
    """
    needed = -(-(first_offset + n_tokens) // page_size) if n_tokens else 0
    if needed > len(pages):
        raise ValueError(f"{n_tokens} tokens from offset {first_offset} need {needed} pages, got {len(pages)}")
    return [
        pages[(first_offset + i) // page_size] * page_size + (first_offset + i) % page_size for i in range(n_tokens)
    ]


def row_hash_py(row: bytes) -> int:
    """``r`` of one row given its raw bytes (pure Python, for tiny cross-checks)."""
    words = [int.from_bytes(row[i : i + 4], "little", signed=True) for i in range(0, len(row), 4)]
    return sum(m * x for m, x in zip(multipliers(len(words)), words, strict=True)) & MASK64


def digest_rows_py(
    rows: Sequence[Sequence[Sequence[bytes]]], layout: KVLayout, start_token: int = 0
) -> tuple[int, ...]:
    """Pure-Python digest: ``rows[lh][i][j]`` is the raw bytes of (layer_half lh, i-th token, local head j)."""
    check_layout(layout)
    n_tokens = len(rows[0]) if rows else 0
    sums = [0] * layout.num_heads
    for lh, tokens in enumerate(rows):
        for i, heads in enumerate(tokens):
            key = row_key(lh, start_token + i)
            for j, row in enumerate(heads):
                sums[j] = (sums[j] + mix64(row_hash_py(row) + key)) & MASK64
    return finalize(sums, layout, start_token, n_tokens)
