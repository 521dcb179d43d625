"""The KV digest launched without the host waiting for the GPU: the per-head sums are computed on a stream, copied
into pinned memory and finalised on the host once they landed (:class:`PendingDigest`).

On a GPU the sums come from ``on_device`` (the plugin passes its cached Triton digester where Triton and CUDA are
there, the backport series the torch path); on the CPU the digest is computed at once by ``on_host`` (the plugin's
native C path, the series' torch path). Bit for bit the same digests either way (:mod:`.digest_spec`). Shared by the
plugin and the backport series (bundled into its ``pd_digest``); it imports no kernel itself, so that importing it
needs no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from sglang_harden.kernels.device import HostCopy, on_accelerator
from sglang_harden.kernels.digest_spec import MASK64, KVLayout, ShardDigest, finalize

# (k_buffers, v_buffers, slots, layout, start_token) -> per-head digests (host) / per-head sums (device tensor)
HostDigest = Callable[[Sequence[Any], Sequence[Any] | None, Any, KVLayout, int], tuple[int, ...]]
DeviceSums = Callable[[Sequence[Any], Sequence[Any] | None, Any, KVLayout, int], Any]


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
            self._digests = _finalized(self._sums.numpy().tolist(), self.layout, self.start_token, self.n_tokens)
        return ShardDigest(self.layout, self.start_token, self.n_tokens, self._digests, self.rank)


def _finalized(sums: Sequence[int], layout: KVLayout, start_token: int, n_tokens: int) -> tuple[int, ...]:
    return finalize([int(s) & MASK64 for s in sums], layout, start_token, n_tokens)


def launch_digest(k_buffers: Sequence[Any], v_buffers: Sequence[Any] | None, slots: Any, layout: KVLayout,
                  start_token: int = 0, rank: int = 0, stream: Any = None, *, on_host: HostDigest,
                  on_device: DeviceSums) -> PendingDigest:
    """Start the digest of the rows at pool ``slots`` (an int64 tensor on the pool's device) on ``stream`` (None:
    the current one)."""
    n_tokens = int(slots.numel())
    if not on_accelerator(k_buffers[0]):
        digests = on_host(k_buffers, v_buffers, slots, layout, start_token)
        return PendingDigest(layout, start_token, n_tokens, rank, digests=digests)
    import torch

    stream = stream if stream is not None else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        sums = on_device(k_buffers, v_buffers, slots, layout, start_token)
        copy = HostCopy.launch([sums], stream)
    return PendingDigest(layout, start_token, n_tokens, rank, sums=copy)
