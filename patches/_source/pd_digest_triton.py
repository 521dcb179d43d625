"""The KV digest's Triton kernel (sglang-harden backport, not upstream SGLang code).

``pd_digest`` digests a request's KV rows on the device with this kernel where the pool lives on CUDA and the tree
has Triton (importing this module imports Triton; without it ``pd_digest`` takes its torch path, bit for bit the
same digests). One pass over the digested bytes; one digester per pool, whose buffer address table is uploaded
once. The kernel is sglang-harden's own (``kernels/digest_triton.py``), put in below when the series is generated.
"""

from __future__ import annotations

import threading

# <bundle sglang_harden/kernels/digest_spec.py sglang_harden/kernels/digest_ref.py sglang_harden/kernels/digest_torch.py sglang_harden/kernels/digest_triton.py>


# ---- the backport's own glue

MAX_DIGESTERS = 8
_DIGESTERS: dict[tuple, TritonDigester] = {}
_LOCK = threading.Lock()


def sums(k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor] | None, slots: torch.Tensor,
         layout: KVLayout, start_token: int) -> torch.Tensor:
    """The per-head sums of the rows at pool ``slots`` on the device (no host synchronisation)."""
    key = (layout, tuple(b.data_ptr() for b in k_buffers), tuple(b.data_ptr() for b in v_buffers or ()))
    with _LOCK:
        digester = _DIGESTERS.get(key)
        if digester is None:
            digester = _DIGESTERS[key] = TritonDigester(k_buffers, v_buffers, layout)
            while len(_DIGESTERS) > MAX_DIGESTERS:
                _DIGESTERS.pop(next(iter(_DIGESTERS)))
    return digester.sums(slots.contiguous(), start_token)
