"""The KV digest launched without the host waiting for the GPU: the per-head sums are computed on a stream, copied
into pinned memory and finalised on the host once they landed (:class:`PendingDigest`).

On a GPU the sums come from the Triton kernel (one cached :class:`~.digest_triton.TritonDigester` per pool: its
address table is uploaded once) or, without Triton, from the torch path; on the CPU the digest is computed at once
(native C, else torch). Bit for bit the same digests either way (:mod:`.digest_spec`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from sglang_harden.kernels.device import HostCopy, on_accelerator
from sglang_harden.kernels.digest import compute_digests, triton_available
from sglang_harden.kernels.digest_spec import MASK64, KVLayout, ShardDigest, finalize

MAX_DIGESTERS = 8
_digesters: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
_digesters_lock = threading.Lock()


class PendingDigest:
    """One rank's digest of a request's rows: ready at once on the CPU, else once its sums landed on the host."""

    def __init__(self, layout: KVLayout, start_token: int, n_tokens: int, rank: int,
                 sums: HostCopy | None = None, digests: tuple[int, ...] | None = None) -> None:
        self.layout, self.start_token, self.n_tokens, self.rank = layout, start_token, n_tokens, rank
        self._sums, self._digests = sums, digests

    def ready(self) -> bool:
        return self._sums is None or self._sums.ready()

    def wait(self) -> None:
        """Block until the sums landed (a host synchronisation: background threads only, e.g. the publisher)."""
        if self._sums is not None:
            self._sums.wait()

    def shard(self) -> ShardDigest:
        """The shard digest (only once :meth:`ready`)."""
        if self._digests is None:
            assert self._sums is not None
            sums = [int(s) & MASK64 for s in self._sums.numpy().tolist()]
            self._digests = finalize(sums, self.layout, self.start_token, self.n_tokens)
        return ShardDigest(self.layout, self.start_token, self.n_tokens, self._digests, self.rank)


def _digester(k_buffers: Sequence[Any], v_buffers: Sequence[Any] | None, layout: KVLayout) -> Any:
    """The pool's Triton digester, made once (its address table upload blocks, once)."""
    from sglang_harden.kernels.digest_triton import TritonDigester

    key = (layout, tuple(b.data_ptr() for b in k_buffers), tuple(b.data_ptr() for b in v_buffers or ()))
    with _digesters_lock:
        digester = _digesters.get(key)
        if digester is None:
            digester = _digesters[key] = TritonDigester(k_buffers, v_buffers, layout)
            while len(_digesters) > MAX_DIGESTERS:
                _digesters.popitem(last=False)
        return digester


def launch_digest(k_buffers: Sequence[Any], v_buffers: Sequence[Any] | None, slots: Any, layout: KVLayout,
                  start_token: int = 0, rank: int = 0, stream: Any = None) -> PendingDigest:
    """Start the digest of the rows at pool ``slots`` (an int64 tensor on the pool's device) on ``stream`` (None:
    the current one)."""
    n_tokens = int(slots.numel())
    if not on_accelerator(k_buffers[0]):
        digests = compute_digests(k_buffers, v_buffers, slots, layout, start_token)
        return PendingDigest(layout, start_token, n_tokens, rank, digests=digests)
    import torch

    stream = stream if stream is not None else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        if k_buffers[0].is_cuda and triton_available():
            sums = _digester(k_buffers, v_buffers, layout).sums(slots.contiguous(), start_token)
        else:
            from sglang_harden.kernels.digest_torch import sums_torch

            sums = sums_torch(k_buffers, v_buffers, slots, layout, start_token)
        copy = HostCopy.launch([sums], stream)
    return PendingDigest(layout, start_token, n_tokens, rank, sums=copy)
