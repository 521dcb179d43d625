"""Vectorised torch path of the per-KV-head digest; bit-identical to :mod:`.digest_ref`.

Works on any device torch supports (CPU is the target; on CUDA the Triton path is faster). Rows are gathered,
widened and multiplied in cache-sized chunks so that main-memory traffic is one read of the digested bytes;
the per-row mixing runs once at the end over a small ``[layer_halves, tokens, heads]`` int64 tensor.
torch has no uint64 arithmetic, so everything runs on int64 with two's-complement wrap-around, and logical
right shifts are arithmetic shifts plus a mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sglang_harden.kernels.digest_ref import layer_halves
from sglang_harden.kernels.digest_spec import (
    KEY_SALT,
    LAYER_HALF_SHIFT,
    MASK64,
    KVLayout,
    check_layout,
    finalize,
    multipliers,
    to_signed64,
)

DEFAULT_CHUNK_BYTES = 1 << 19  # CPU: keep the widened chunk in L2
CUDA_CHUNK_BYTES = 1 << 28  # CUDA: few large launches
_MIX1 = to_signed64(0xBF58476D1CE4E5B9)
_MIX2 = to_signed64(0x94D049BB133111EB)


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def mix64_torch(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64 finaliser over an int64 tensor (bit patterns as uint64)."""
    z = z ^ _shr(z, 30)
    z = z * _MIX1
    z = z ^ _shr(z, 27)
    z = z * _MIX2
    return z ^ _shr(z, 31)


def words_torch(buf: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """``buf`` (``[pool_slots, num_heads, head_dim]``, any dtype) viewed as int32 words, no copy."""
    if buf.dim() != 3 or buf.shape[1] != layout.num_heads or buf.shape[2] * buf.element_size() != layout.row_bytes:
        raise ValueError(f"buffer {tuple(buf.shape)} x {buf.element_size()}B does not match layout {layout}")
    if buf.stride(2) != 1:
        raise ValueError("the head_dim axis must be contiguous")
    return buf.view(torch.uint8).view(torch.int32)


def word_views(
    k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor] | None, layout: KVLayout
) -> tuple[list[torch.Tensor], int, int]:
    """The layer halves as int32 word views (:func:`words_torch`), with the slot and head strides (in words)
    that all of them share; the kernels that walk raw pointers need one row layout for every buffer."""
    check_layout(layout)
    halves = [words_torch(b, layout) for b in layer_halves(k_buffers, v_buffers, layout)]
    strides = {(h.stride(0), h.stride(1)) for h in halves}
    if len(strides) != 1 or halves[0].stride(2) != 1:
        raise ValueError(f"layer buffers must share one row layout, got strides {strides}")
    stride_slot, stride_head = strides.pop()
    return halves, stride_slot, stride_head


def row_keys_torch(num_halves: int, n_tokens: int, start_token: int, device: torch.device) -> torch.Tensor:
    tokens = torch.arange(start_token, start_token + n_tokens, dtype=torch.int64, device=device)
    lh = torch.arange(num_halves, dtype=torch.int64, device=device) << LAYER_HALF_SHIFT
    return mix64_torch((lh[:, None] ^ tokens[None, :]) ^ KEY_SALT)


_MULTIPLIERS: dict[tuple[int, str], torch.Tensor] = {}


def multipliers_torch(words: int, device: torch.device) -> torch.Tensor:
    """The row multipliers on ``device``, uploaded once per (width, device) from pinned memory, without the host
    waiting for the device."""
    key = (words, str(device))
    mult = _MULTIPLIERS.get(key)
    if mult is None:
        host = torch.tensor([to_signed64(m) for m in multipliers(words)], dtype=torch.int64)
        if getattr(device, "type", device) == "cuda":
            host = host.pin_memory()
        mult = _MULTIPLIERS[key] = host.to(device, non_blocking=True)
    return mult


def row_hashes_torch(
    halves: Sequence[torch.Tensor], idx: torch.Tensor, layout: KVLayout, chunk_bytes: int
) -> torch.Tensor:
    """``r`` for every (layer_half, token, head): int64 ``[len(halves), n, num_heads]``."""
    heads, words = layout.num_heads, layout.words_per_row
    device = idx.device
    mult = multipliers_torch(words, device)
    n = idx.numel()
    out = torch.empty((len(halves), n, heads), dtype=torch.int64, device=device)
    step = max(1, min(n, chunk_bytes // (heads * words * 4)))
    gathered = torch.empty((step, heads, words), dtype=torch.int32, device=device)
    wide = torch.empty((step, heads, words), dtype=torch.int64, device=device)
    for lh, buf in enumerate(halves):
        src = words_torch(buf, layout)
        for a in range(0, n, step):
            m = min(step, n - a)
            g = torch.index_select(src, 0, idx[a : a + m], out=gathered[:m])
            torch.mul(g, mult, out=wide[:m])
            torch.sum(wide[:m], dim=-1, out=out[lh, a : a + m])
    return out


def sums_torch(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor] | None,
    idx: torch.Tensor,
    layout: KVLayout,
    start_token: int = 0,
    chunk_bytes: int | None = None,
) -> torch.Tensor:
    """Per-head sums ``S_h`` (int64 bit patterns) on the buffers' device, without a host synchronisation;
    ``idx``: the pool slots, an int64 tensor on that device."""
    check_layout(layout)
    halves = layer_halves(k_buffers, v_buffers, layout)
    device = halves[0].device
    if chunk_bytes is None:
        chunk_bytes = CUDA_CHUNK_BYTES if device.type == "cuda" else DEFAULT_CHUNK_BYTES
    rows = row_hashes_torch(halves, idx, layout, chunk_bytes)
    keys = row_keys_torch(len(halves), idx.numel(), start_token, device)
    return mix64_torch(rows + keys[:, :, None]).sum(dim=(0, 1))


def digest_torch(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor] | None,
    slots: Sequence[int] | torch.Tensor,
    layout: KVLayout,
    start_token: int = 0,
    chunk_bytes: int | None = None,
) -> tuple[int, ...]:
    """Per-head digests ``D_h`` (local head order) of the rows at pool ``slots`` (send order)."""
    idx = torch.as_tensor(slots, dtype=torch.int64).to(k_buffers[0].device)
    sums = sums_torch(k_buffers, v_buffers, idx, layout, start_token, chunk_bytes)
    return finalize([s & MASK64 for s in sums.tolist()], layout, start_token, idx.numel())
