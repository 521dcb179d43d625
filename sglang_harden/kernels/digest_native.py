"""Native CPU path of the per-KV-head digest; bit-identical to :mod:`.digest_ref`.

The torch path cannot hash at memory speed on a CPU: torch has no fused multiply-and-reduce for integers, so
each chunk makes several passes and the row hashes are widened to int64. This path is one small C function
(``digest_native.c``, next to this file) that reads every digested byte once. It is compiled with the system C
compiler (by ``sglang-harden build-kernels``, or on first use) into ``$SGLANG_HARDEN_HOME/kernels`` (default
``~/.cache/sglang-harden/kernels``), keyed by the source and the flags, and loaded with ctypes
(:mod:`.native_build`). ctypes drops the GIL during the call, so the layer halves are split over ``threads`` Python
threads.

No compiler, a failed build or ``SGLANG_HARDEN_NATIVE_DIGEST=0``: :func:`native_library` returns ``None`` and
callers use the torch path (same digests, slower). :func:`native_status` says which and why, for ``doctor``.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sglang_harden.kernels.digest_spec import (
    KEY_SALT,
    LAYER_HALF_SHIFT,
    MASK64,
    KVLayout,
    finalize,
    multipliers,
)
from sglang_harden.kernels.native_build import BASE_FLAGS, cpu_flags, load_library

SOURCE = Path(__file__).with_name("digest_native.c")
DISABLE_ENV = "SGLANG_HARDEN_NATIVE_DIGEST"
SPLIT_BYTES = 8 << 20  # below this a request's digest runs on the calling thread (waking workers costs more)
MAX_CACHED_DIGESTERS = 16

_lock = threading.Lock()
_loaded: dict[str, Any] = {}  # "lib" -> ctypes.CDLL or None, "why" -> str
_pool: dict[int, ThreadPoolExecutor] = {}


def _load() -> tuple[Any, str]:
    lib, why = load_library(SOURCE, "digest", DISABLE_ENV, (*BASE_FLAGS, *cpu_flags()))
    if lib is None:
        return None, why
    fn = lib.sgh_digest_sums
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int64, ctypes.c_void_p]  # fmt: skip
    return lib, why


def native_library() -> Any:
    """The loaded kernel library, building it on first use; ``None`` when unavailable (see native_status)."""
    with _lock:
        if "lib" not in _loaded:
            _loaded["lib"], _loaded["why"] = _load()
        return _loaded["lib"]


def native_status() -> tuple[bool, str]:
    lib = native_library()
    return lib is not None, _loaded["why"]


def _executor(threads: int) -> ThreadPoolExecutor:
    with _lock:
        if threads not in _pool:
            _pool[threads] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="sglang-harden-digest")
        return _pool[threads]


def default_threads() -> int:
    import torch

    return max(1, torch.get_num_threads())


class NativeDigester:
    """Prepared native digest for one pool: buffer pointers, strides and multipliers are set up once."""

    def __init__(self, k_buffers: Sequence[Any], v_buffers: Sequence[Any] | None, layout: KVLayout) -> None:
        from sglang_harden.kernels.digest_torch import word_views

        lib = native_library()
        if lib is None:
            raise RuntimeError(f"native digest unavailable: {_loaded['why']}")
        halves, self.stride_slot, self.stride_head = word_views(k_buffers, v_buffers, layout)
        if any(h.device.type != "cpu" for h in halves):
            raise ValueError("the native digest reads CPU tensors only")
        self._fn = lib.sgh_digest_sums
        self.layout = layout
        self.pool_rows = halves[0].shape[0]
        self._halves = halves  # keeps the storage behind the raw pointers alive
        self.pointers = tuple(h.data_ptr() for h in halves)
        words = layout.words_per_row
        mult = multipliers(words)
        self._mult_lo = (ctypes.c_uint32 * words)(*[m & 0xFFFFFFFF for m in mult])
        self._mult_hi = (ctypes.c_uint32 * words)(*[m >> 32 for m in mult])
        self._bases: dict[int, list[tuple[int, int, Any]]] = {}

    def digest(self, slots: Sequence[int] | Any, start_token: int = 0, threads: int | None = None) -> tuple[int, ...]:
        """Per-head digests ``D_h`` (local head order) of the rows at pool ``slots`` (send order)."""
        import torch

        idx = torch.as_tensor(slots, dtype=torch.int64).contiguous()
        n = idx.numel()
        if n and (int(idx.min()) < 0 or int(idx.max()) >= self.pool_rows):
            raise ValueError(f"slots outside the pool of {self.pool_rows} rows")
        heads = self.layout.num_heads
        idx, order = visiting_order(idx)
        nbytes = n * heads * self.layout.row_bytes * len(self.pointers)
        wanted = threads or (default_threads() if nbytes >= SPLIT_BYTES else 1)
        parts = self._parts(wanted)
        sums = [(ctypes.c_uint64 * heads)() for _ in parts]

        order_ptr = order.data_ptr() if order is not None else None

        def run(part: int) -> None:
            first, count, bases = parts[part]
            self._fn(
                bases, first, count, idx.data_ptr(), order_ptr, n, start_token, heads, self.layout.words_per_row,
                self.stride_slot, self.stride_head, self._mult_lo, self._mult_hi, KEY_SALT, LAYER_HALF_SHIFT,
                sums[part],
            )  # fmt: skip

        if len(parts) == 1:
            run(0)
        else:
            list(_executor(len(parts)).map(run, range(len(parts))))
        totals = [sum(s[h] for s in sums) & MASK64 for h in range(heads)]
        return finalize(totals, self.layout, start_token, n)

    def _parts(self, threads: int) -> list[tuple[int, int, Any]]:
        """The layer halves in at most ``threads`` contiguous runs: ``(first_half, count, pointer array)``."""
        if threads not in self._bases:
            runs = split_halves(len(self.pointers), threads)
            self._bases[threads] = [
                (first, count, (ctypes.c_void_p * count)(*self.pointers[first : first + count]))
                for first, count in runs
            ]
        return self._bases[threads]


_digesters: dict[tuple[Any, ...], NativeDigester] = {}


def digest_native(
    k_buffers: Sequence[Any],
    v_buffers: Sequence[Any] | None,
    slots: Sequence[int] | Any,
    layout: KVLayout,
    start_token: int = 0,
    threads: int | None = None,
) -> tuple[int, ...]:
    """:meth:`NativeDigester.digest`, with the digester of these buffers kept for the next call."""
    buffers = [*k_buffers, *(v_buffers or ())]
    key = (layout, *((b.data_ptr(), tuple(b.shape), tuple(b.stride())) for b in buffers))
    digester = _digesters.get(key)
    if digester is None:
        digester = NativeDigester(k_buffers, v_buffers, layout)
        if len(_digesters) >= MAX_CACHED_DIGESTERS:
            _digesters.clear()
        _digesters[key] = digester
    return digester.digest(slots, start_token, threads)


def visiting_order(slots: Any) -> tuple[Any, Any]:
    """``(slots sorted by address, the send position of each)``; ``(slots, None)`` when already in order."""
    import torch

    if slots.numel() < 2 or bool((slots[1:] >= slots[:-1]).all()):
        return slots, None
    ordered, order = torch.sort(slots)
    return ordered.contiguous(), order.contiguous()


def split_halves(n_halves: int, threads: int) -> list[tuple[int, int]]:
    """``[(first_half, count), ...]``: ``n_halves`` layer halves in at most ``threads`` contiguous runs."""
    threads = max(1, min(threads, n_halves))
    base, extra = divmod(n_halves, threads)
    runs, first = [], 0
    for i in range(threads):
        count = base + (1 if i < extra else 0)
        runs.append((first, count))
        first += count
    return runs
