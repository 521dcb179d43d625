"""Triton path of the per-KV-head digest; bit-identical to :mod:`.digest_ref`.

One pass over the digested bytes: program ``(layer_half, token_block, head)`` gathers ``BLOCK_T`` rows of one
head through the slot list, computes the multilinear row hashes and the keyed row mix in registers, and writes
one uint64 partial sum. The host adds the ``[layer_halves * token_blocks, heads]`` partials (wrapping int64)
and finalises on the CPU. Layer buffers are separate allocations in SGLang pools, so their base addresses are
passed as an int64 table and cast to pointers inside the kernel. Runs on CUDA, and on CPU tensors under
``TRITON_INTERPRET=1`` (slowly; for tests).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from sglang_harden.kernels.digest_spec import (
    KEY_SALT,
    LAYER_HALF_SHIFT,
    MASK64,
    KVLayout,
    finalize,
    multipliers,
    to_signed64,
)
from sglang_harden.kernels.digest_torch import word_views


@triton.jit
def _mix64(z):
    z = z ^ (z >> 30)
    z = z * 0xBF58476D1CE4E5B9
    z = z ^ (z >> 27)
    z = z * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _digest_kernel(
    table_ptr,
    slots_ptr,
    mult_ptr,
    partial_ptr,
    n_tokens,
    start_token,
    n_blocks,
    stride_slot,
    stride_head,
    HEADS: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
    KEY: tl.constexpr,
    SHIFT: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    lh = tl.program_id(0)
    tb = tl.program_id(1)
    head = tl.program_id(2)
    base = tl.load(table_ptr + lh).to(tl.pointer_type(tl.int32))
    offs_t = tb * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < n_tokens
    slot = tl.load(slots_ptr + offs_t, mask=t_ok, other=0)
    offs_w = tl.arange(0, BLOCK_W)
    w_ok = offs_w < WORDS
    row = slot * stride_slot + head * stride_head
    if ALIGNED:  # 16-byte aligned rows: lets the compiler use 128-bit loads
        base = tl.multiple_of(base, 16)
        row = tl.multiple_of(row, 4)
    x = tl.load(base + row[:, None] + offs_w[None, :], mask=t_ok[:, None] & w_ok[None, :], other=0)
    mult = tl.load(mult_ptr + offs_w, mask=w_ok, other=0).to(tl.uint64, bitcast=True)
    wide = x.to(tl.int64).to(tl.uint64, bitcast=True)
    r = tl.sum(wide * mult[None, :], axis=1)
    token = (start_token + offs_t).to(tl.uint64)
    lh_bits = lh.to(tl.uint64) << SHIFT
    key = _mix64((token ^ lh_bits) ^ KEY)
    contrib = tl.where(t_ok, _mix64(r + key), 0)
    total = tl.sum(contrib, axis=0)
    tl.store(partial_ptr + (lh * n_blocks + tb) * HEADS + head, total.to(tl.int64, bitcast=True))


class TritonDigester:
    """Prepared digest for one pool: buffer address table and multipliers are built once."""

    def __init__(
        self,
        k_buffers: Sequence[torch.Tensor],
        v_buffers: Sequence[torch.Tensor] | None,
        layout: KVLayout,
        block_t: int = 32,
    ) -> None:
        self.layout = layout
        halves, self.stride_slot, self.stride_head = word_views(k_buffers, v_buffers, layout)
        self.device = halves[0].device
        self._halves = halves  # keep the views (and their storage) alive while the table is in use
        self.table = torch.tensor([h.data_ptr() for h in halves], dtype=torch.int64, device=self.device)
        words = layout.words_per_row
        self.mult = torch.tensor([to_signed64(m) for m in multipliers(words)], dtype=torch.int64, device=self.device)
        self.aligned = (
            all(h.data_ptr() % 16 == 0 for h in halves) and self.stride_slot % 4 == 0 and self.stride_head % 4 == 0
        )
        self.block_t = block_t
        self.block_w = triton.next_power_of_2(words)

    def sums(self, slots: torch.Tensor, start_token: int = 0) -> torch.Tensor:
        """Per-head ``S_h`` as int64 bit patterns on the device (no host sync)."""
        n = slots.numel()
        heads = self.layout.num_heads
        n_blocks = max(1, triton.cdiv(n, self.block_t))
        partial = torch.zeros((len(self._halves), n_blocks, heads), dtype=torch.int64, device=self.device)
        if n:
            grid = (len(self._halves), n_blocks, heads)
            _digest_kernel[grid](
                self.table,
                slots,
                self.mult,
                partial,
                n,
                start_token,
                n_blocks,
                self.stride_slot,
                self.stride_head,
                HEADS=heads,
                WORDS=self.layout.words_per_row,
                BLOCK_T=self.block_t,
                BLOCK_W=self.block_w,
                KEY=KEY_SALT,
                SHIFT=LAYER_HALF_SHIFT,
                ALIGNED=self.aligned,
            )
        return partial.sum(dim=(0, 1))

    def digest(self, slots: Sequence[int] | torch.Tensor, start_token: int = 0) -> tuple[int, ...]:
        idx = torch.as_tensor(slots, dtype=torch.int64).to(self.device).contiguous()
        sums = self.sums(idx, start_token).tolist()
        return finalize([s & MASK64 for s in sums], self.layout, start_token, idx.numel())


def digest_triton(
    k_buffers: Sequence[torch.Tensor],
    v_buffers: Sequence[torch.Tensor] | None,
    slots: Sequence[int] | torch.Tensor,
    layout: KVLayout,
    start_token: int = 0,
) -> tuple[int, ...]:
    """One-shot form of :class:`TritonDigester` (builds the address table every call)."""
    return TritonDigester(k_buffers, v_buffers, layout).digest(slots, start_token)


MAX_DIGESTERS = 8
_DIGESTERS: dict[tuple, TritonDigester] = {}
_DIGESTERS_LOCK = threading.Lock()


def sums_triton(k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor] | None, slots: torch.Tensor,
                layout: KVLayout, start_token: int = 0) -> torch.Tensor:
    """Per-head sums on the device (no host synchronisation) from the pool's digester, made once per pool (its
    address table upload blocks, once)."""
    key = (layout, tuple(b.data_ptr() for b in k_buffers), tuple(b.data_ptr() for b in v_buffers or ()))
    with _DIGESTERS_LOCK:
        digester = _DIGESTERS.get(key)
        if digester is None:
            digester = _DIGESTERS[key] = TritonDigester(k_buffers, v_buffers, layout)
            while len(_DIGESTERS) > MAX_DIGESTERS:
                _DIGESTERS.pop(next(iter(_DIGESTERS)))
    return digester.sums(slots.contiguous(), start_token)
