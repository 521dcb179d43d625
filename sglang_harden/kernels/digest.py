"""One entry point over the digest backends: Triton on CUDA tensors, native C on CPU tensors (torch when no
compiler is available), numpy for arrays.

All backends return the same per-head digests bit for bit (see :mod:`.digest_spec` for the definition).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import Any

from sglang_harden.kernels.digest_spec import KVLayout, ShardDigest

BACKENDS = ("auto", "numpy", "torch", "triton", "native")


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def pick_backend(first_buffer: Any, backend: str = "auto") -> str:
    """``auto``: numpy for numpy arrays, Triton for CUDA tensors when importable, native C for CPU tensors when
    it builds (:func:`.digest_native.native_status`), torch otherwise."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown digest backend {backend!r}; known: {', '.join(BACKENDS)}")
    if backend != "auto":
        return backend
    if type(first_buffer).__module__ == "numpy":
        return "numpy"
    if getattr(first_buffer, "is_cuda", False):
        return "triton" if triton_available() else "torch"
    from sglang_harden.kernels.digest_native import native_library

    return "native" if native_library() is not None else "torch"


def compute_digests(
    k_buffers: Sequence[Any],
    v_buffers: Sequence[Any] | None,
    slots: Sequence[int] | Any,
    layout: KVLayout,
    start_token: int = 0,
    backend: str = "auto",
) -> tuple[int, ...]:
    """Per-head digests (local head order) of the request's rows at pool ``slots``, in send order."""
    chosen = pick_backend(k_buffers[0], backend)
    if chosen == "numpy":
        from sglang_harden.kernels.digest_ref import digest_numpy

        return digest_numpy(k_buffers, v_buffers, slots, layout, start_token)
    if chosen == "triton":
        from sglang_harden.kernels.digest_triton import digest_triton

        return digest_triton(k_buffers, v_buffers, slots, layout, start_token)
    if chosen == "native":
        from sglang_harden.kernels.digest_native import digest_native

        return digest_native(k_buffers, v_buffers, slots, layout, start_token)
    from sglang_harden.kernels.digest_torch import digest_torch

    return digest_torch(k_buffers, v_buffers, slots, layout, start_token)


def shard_digest(
    k_buffers: Sequence[Any],
    v_buffers: Sequence[Any] | None,
    slots: Sequence[int] | Any,
    layout: KVLayout,
    start_token: int = 0,
    rank: int = 0,
    backend: str = "auto",
) -> ShardDigest:
    """What a rank publishes (prefill) or compares (decode) for one request."""
    digests = compute_digests(k_buffers, v_buffers, slots, layout, start_token, backend)
    return ShardDigest(layout, start_token, len(slots), digests, rank)
