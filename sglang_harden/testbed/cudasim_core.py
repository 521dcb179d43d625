"""The CUDA simulator's shared state (test-only; see ``cudasim``): the simulated device and device marks, the
counts and their attribution, and the registry of bytes an asynchronous copy has not written yet. Importable in any
process with torch; thread-safe (one ``RLock``): the transfer worker thread lands copies the scheduler issued.

Attribution. A count goes to the first frame on the stack outside torch and outside the simulator: owner
``sglang_harden`` (a file under ``sglang_harden/`` but not ``sglang_harden/testbed/``, or a backported module
``sglang/srt/**/pd_*.py``), ``sglang`` (under ``/sglang/``) or ``other``. Frames inside Triton are the Triton
interpreter emulating a device kernel on CPU (its host copies do not happen on a GPU): those ops are not counted.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from collections import Counter
from types import FrameType
from typing import Any

import torch

POISON_ENV = "SGLANG_HARDEN_TESTBED_CUDASIM_POISON"
DEVICE_MARK = "_sglang_harden_cudasim_device"
PINNED_MARK = "_sglang_harden_cudasim_pinned"

LOCK = threading.RLock()
MODED_THREADS: set[int] = set()  # idents of the threads the mode is pushed on
# storage data_ptr -> byte ranges [start, end) with a copy in flight (read without the lock: a dict lookup)
PENDING: dict[int, list[tuple[int, int]]] = {}


# ------------------------------------------------------------------------------------------------ devices


class SimDevice(str):
    """The simulated GPU: a device name torch accepts (a ``str``) that the simulator recognises.

    ``type`` and ``index`` read like ``torch.device``'s; it equals ``torch.device("cpu")`` when compared from its own
    side (``torch.device.__eq__`` answers False for any non-device, which the simulator cannot change)."""

    type: str
    index: int | None

    def __new__(cls, name: str = "cpu") -> SimDevice:
        obj = super().__new__(cls, name)
        kind, _, index = name.partition(":")
        obj.type, obj.index = kind, (int(index) if index else None)
        return obj

    def __eq__(self, other: object) -> bool:
        if isinstance(other, torch.device):
            return other.type == self.type and (other.index is None or self.index in (None, other.index))
        return str.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = str.__hash__

    def __repr__(self) -> str:
        return f"SimDevice({str.__str__(self)!r})"

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return SimDevice, (str.__str__(self),)


def is_device(t: object) -> bool:
    """Whether ``t`` is a simulated device tensor."""
    return getattr(t, DEVICE_MARK, False) is True


class _Stats:
    def __init__(self) -> None:
        self.syncs: Counter[tuple[str, str, str]] = Counter()  # (owner, kind, site)
        self.poisoned: Counter[tuple[str, str, str]] = Counter()  # (owner, op, site)
        self.async_copies: Counter[tuple[str, str]] = Counter()  # (owner, site) of each copy put in flight
        self.landed: Counter[str] = Counter()  # copies landed, by what made the host wait
        self.marked = 0
        self.passes = 0


STATS = _Stats()


def mark_device(t: Any) -> Any:
    """Mark ``t`` (a tensor) as living on the simulated device; returns it."""
    setattr(t, DEVICE_MARK, True)
    STATS.marked += 1
    return t


def mark_pinned(t: Any) -> Any:
    setattr(t, PINNED_MARK, True)
    return t


def is_pinned(t: Any) -> bool:
    """The simulator's answer to ``Tensor.is_pinned()``: the tensor or the tensor it views was pinned."""
    if getattr(t, PINNED_MARK, False):
        return True
    with torch._C.DisableTorchFunction():
        base = t._base
    return base is not None and bool(getattr(base, PINNED_MARK, False))


# ---------------------------------------------------------------------------------------------- attribution

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
SIM_FILES: set[str] = set()


def register_sim_file(code_filename: str) -> None:
    """Frames of this file are the simulator's own: attribution looks past them."""
    SIM_FILES.add(code_filename)


def owner_of(path: str) -> str | None:
    """``sglang_harden`` | ``sglang`` | ``other``; None for the Triton interpreter (an emulated device kernel)."""
    p = path.replace(os.sep, "/")
    if "/sglang_harden/" in p:
        return "other" if "/sglang_harden/testbed/" in p else "sglang_harden"
    if "/sglang/srt/" in p and p.rsplit("/", 1)[-1].startswith("pd_"):
        return "sglang_harden"  # a module the backport series adds to SGLang's tree
    if "/triton/" in p:
        return None
    if "/sglang/" in p:
        return "sglang"
    return "other"


def short_path(path: str) -> str:
    p = path.replace(os.sep, "/")
    for anchor in ("/sglang_harden/", "/sglang/"):
        if anchor in p:
            return p[p.rindex(anchor) + 1:]
    return "/".join(p.rsplit("/", 2)[-2:])


def caller(frame: FrameType | None = None) -> tuple[str, str] | None:
    """(owner, "file:line:function") of the first frame outside torch and the simulator; None inside Triton."""
    f = frame if frame is not None else sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if name in SIM_FILES or name.startswith(_TORCH_DIR):
            f = f.f_back
            continue
        owner = owner_of(name)
        if owner is None:
            return None
        code = f.f_code
        return owner, f"{short_path(name)}:{f.f_lineno}:{getattr(code, 'co_qualname', code.co_name)}"
    return "other", "?"


def on_moded_thread() -> bool:
    return threading.get_ident() in MODED_THREADS


def count_sync(kind: str) -> bool:
    """Count a host synchronisation if this is the moded thread (attributed to the caller); True when counted."""
    if not on_moded_thread():
        return False
    where = caller()
    if where is None:
        return False
    with LOCK:
        STATS.syncs[(where[0], kind, where[1])] += 1
    return True


def note_poisoned_read(op: str) -> None:
    where = caller() or ("other", "?")
    with LOCK:
        STATS.poisoned[(where[0], op, where[1])] += 1


def note_thread_wait(kind: str = "thread_wait") -> None:
    """A blocking wait of the moded thread, counted only when sglang_harden's code waits."""
    where = caller()
    if where is not None and where[0] == "sglang_harden":
        with LOCK:
            STATS.syncs[(where[0], kind, where[1])] += 1


# ---------------------------------------------------------------------------------------- pending copies


def span(t: Any) -> tuple[int, int, int]:
    """(storage data_ptr, first byte, end byte) of what ``t`` can read."""
    with torch._C.DisableTorchFunction():
        size = t.element_size()
        start = t.storage_offset() * size
        key = t.untyped_storage().data_ptr()
        if t.numel() == 0:
            return key, start, start
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
        return key, start, start + (last + 1) * size


def pending_read(t: Any) -> bool:
    """Whether reading ``t`` now would read bytes an asynchronous copy has not written yet."""
    if not PENDING or not isinstance(t, torch.Tensor):
        return False
    try:
        key, start, end = span(t)
    except Exception:  # a tensor without storage (meta, sparse): nothing in flight
        return False
    ranges = PENDING.get(key)
    return bool(ranges) and any(s < end and start < e for s, e in list(ranges))


def poison_value(dtype: torch.dtype) -> bool | int | float:
    """Integers: 0 (SGLang's reserved dummy page) unless the env var says; floats: NaN unless it says."""
    raw = os.environ.get(POISON_ENV, "").strip()
    if dtype == torch.bool:
        return False
    if dtype.is_floating_point or dtype.is_complex:
        try:
            return float(raw) if raw else math.nan
        except ValueError:
            return math.nan
    try:
        return int(raw) if raw else 0
    except ValueError:
        return 0


def reset_counts() -> None:
    with LOCK:
        STATS.syncs.clear()
        STATS.poisoned.clear()
        STATS.async_copies.clear()
        STATS.landed.clear()
        STATS.marked = 0
        STATS.passes = 0


register_sim_file(caller.__code__.co_filename)
