"""numpy reference of the per-KV-head digest (definition in :mod:`sglang_harden.kernels.digest_spec`).

Straightforward and unoptimised on purpose: it is what the torch and Triton paths are tested against.
Buffers are numpy arrays of shape ``[pool_slots, num_heads, head_dim]`` of any dtype (bf16 given as uint16 or
int16, fp8 as uint8); only their raw bytes matter.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from sglang_harden.kernels.digest_spec import (
    KEY_SALT,
    LAYER_HALF_SHIFT,
    KVLayout,
    check_layout,
    finalize,
    multipliers,
)


def mix64_np(z: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser over a uint64 array (wrapping arithmetic)."""
    z = z.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z ^= z >> np.uint64(30)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        z ^= z >> np.uint64(27)
        z *= np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return z


def layer_halves(k_buffers: Sequence, v_buffers: Sequence | None, layout: KVLayout) -> list:
    """Buffers in ``layer_half`` order: K0, V0, K1, V1, ... (K0, K1, ... for MLA)."""
    if len(k_buffers) != layout.num_layers:
        raise ValueError(f"{len(k_buffers)} K buffers for {layout.num_layers} layers")
    if layout.kv_halves == 1:
        return list(k_buffers)
    if v_buffers is None or len(v_buffers) != layout.num_layers:
        raise ValueError("K and V layouts need one V buffer per layer")
    return [buf for pair in zip(k_buffers, v_buffers, strict=True) for buf in pair]


def words_np(buf: np.ndarray, layout: KVLayout) -> np.ndarray:
    """``buf`` as little-endian int32 words, shape ``[pool_slots, num_heads, words_per_row]``."""
    arr = np.ascontiguousarray(buf)
    if arr.ndim != 3 or arr.shape[1] != layout.num_heads or arr.shape[2] * arr.itemsize != layout.row_bytes:
        raise ValueError(f"buffer shape {arr.shape} x {arr.itemsize}B does not match layout {layout}")
    return arr.view(np.uint8).reshape(arr.shape[0], layout.num_heads, layout.row_bytes).view("<i4")


def digest_numpy(
    k_buffers: Sequence[np.ndarray],
    v_buffers: Sequence[np.ndarray] | None,
    slots: Sequence[int],
    layout: KVLayout,
    start_token: int = 0,
) -> tuple[int, ...]:
    """Per-head digests ``D_h`` (local head order) of the rows at pool ``slots`` (send order)."""
    check_layout(layout)
    idx = np.asarray(slots, dtype=np.int64)
    mult = np.array(multipliers(layout.words_per_row), dtype=np.uint64)
    tokens = np.arange(idx.size, dtype=np.uint64) + np.uint64(start_token)
    sums = np.zeros(layout.num_heads, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for lh, buf in enumerate(layer_halves(k_buffers, v_buffers, layout)):
            x = words_np(buf, layout)[idx].astype(np.int64).view(np.uint64)
            rows = (x * mult).sum(axis=-1, dtype=np.uint64)
            keys = mix64_np(np.uint64(KEY_SALT) ^ (np.uint64(lh) << np.uint64(LAYER_HALF_SHIFT)) ^ tokens)
            sums += mix64_np(rows + keys[:, None]).sum(axis=0, dtype=np.uint64)
    return finalize([int(s) for s in sums], layout, start_token, int(idx.size))
