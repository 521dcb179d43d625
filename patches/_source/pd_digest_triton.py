"""The KV digest's Triton kernel (sglang-harden backport, not upstream SGLang code).

``pd_digest`` digests a request's KV rows on the device with this kernel where the pool lives on CUDA and the tree
has Triton (importing this module imports Triton; without it ``pd_digest`` takes its torch path, bit for bit the
same digests): ``sums_triton``, one pass over the digested bytes, one digester per pool, whose buffer address table
is uploaded once. The kernel is sglang-harden's own (``kernels/digest_triton.py``), put in below when the series is
generated.
"""

from __future__ import annotations

# <bundle sglang_harden/kernels/digest_spec.py sglang_harden/kernels/digest_ref.py sglang_harden/kernels/digest_torch.py sglang_harden/kernels/digest_triton.py>
