"""The CUDA simulator's streams, events, asynchronous copies and process-wide patches (test-only; see ``cudasim``).

A ``SimStream`` keeps a queue of work that the host has not yet waited for: asynchronous device->host copies into
pinned memory (``_Copy``: destination, snapshot of the source at issue time) and cross-stream waits (``_Dep``).
Every queued item takes a number from one global sequence; an event records ``(stream, number)``. The host waiting
for a stream (``Stream.synchronize``/``query``, ``Event.synchronize``/``query`` of an event recorded on it, a
blocking read on the moded thread, ``torch.cuda.synchronize``) lands that stream's queue up to the number: each
copy writes its snapshot into its destination, each wait lands the other stream up to where it was waited for.
Until a copy lands its destination holds the poison value (``cudasim_core.poison_value``).
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from sglang_harden.testbed.cudasim_core import (
    LOCK,
    MODED_THREADS,
    PENDING,
    STATS,
    SimDevice,
    caller,
    count_sync,
    is_pinned,
    mark_pinned,
    note_poisoned_read,
    pending_read,
    poison_value,
    register_sim_file,
    span,
)

# Queued copies per stream the host never waited for; beyond this the oldest land (a GPU finished them long ago).
MAX_QUEUED_PER_STREAM = 4096


def note_sync(kind: str, land: bool = True) -> None:
    """Count a host synchronisation on the moded thread and, as the host has waited for the current stream, land
    that stream's queued copies. Other threads are not counted."""
    if count_sync(kind) and land and PENDING:
        current_stream().land_all("blocking_op")


class _Copy:
    __slots__ = ("seq", "dst", "snapshot", "key", "range")

    def __init__(self, seq: int, dst: Any, snapshot: Any, key: int, byte_range: tuple[int, int]) -> None:
        self.seq, self.dst, self.snapshot, self.key, self.range = seq, dst, snapshot, key, byte_range

    def land(self, why: str) -> None:
        STATS.landed[why] += 1
        with torch._C.DisableTorchFunction():
            self.dst.copy_(self.snapshot)
        ranges = PENDING.get(self.key)
        if ranges is not None:
            try:
                ranges.remove(self.range)
            except ValueError:
                pass
            if not ranges:
                del PENDING[self.key]


class _Dep:
    __slots__ = ("seq", "stream", "upto")

    def __init__(self, seq: int, stream: SimStream, upto: int) -> None:
        self.seq, self.stream, self.upto = seq, stream, upto


_seq = itertools.count(1)
_last_seq = 0


def _next_seq() -> int:
    global _last_seq
    _last_seq = next(_seq)
    return _last_seq


# ----------------------------------------------------------------------------------------- streams, events

_STREAMS: weakref.WeakSet[SimStream] = weakref.WeakSet()
_stream_ids = itertools.count(1)


class SimStream:
    """``torch.cuda.Stream`` on the CPU testbed: work the host has not waited for is queued here."""

    def __init__(self, device: object = None, priority: int = 0, **_kwargs: object) -> None:
        self.device = SimDevice("cpu")
        self.priority = int(priority)
        self.stream_id = next(_stream_ids)
        self.cuda_stream = self.stream_id
        self.device_index = 0
        self._queue: deque[_Copy | _Dep] = deque()
        with LOCK:
            _STREAMS.add(self)

    def __repr__(self) -> str:
        return f"<SimStream {self.stream_id} priority={self.priority} queued={len(self._queue)}>"

    def _enqueue(self, item: _Copy | _Dep) -> None:
        with LOCK:
            self._queue.append(item)
            while len(self._queue) > MAX_QUEUED_PER_STREAM:
                self._land_item(self._queue.popleft(), "overflow")

    def _land_item(self, item: _Copy | _Dep, why: str) -> None:
        if isinstance(item, _Copy):
            item.land(why)
        else:
            item.stream.land_upto(item.upto, why)

    def land_upto(self, seq: int, why: str) -> None:
        """The host has waited (``why``) for this stream's work up to ``seq``: land it."""
        with LOCK:
            while self._queue and self._queue[0].seq <= seq:
                self._land_item(self._queue.popleft(), why)

    def land_all(self, why: str) -> None:
        self.land_upto(_last_seq, why)

    def query(self) -> bool:
        self.land_all("stream_query")
        return True

    def synchronize(self) -> None:
        note_sync("stream_sync", land=False)
        self.land_all("stream_sync")

    def wait_event(self, event: SimEvent) -> None:
        with LOCK:
            if event._stream is not None and event._stream is not self:
                self._enqueue(_Dep(_next_seq(), event._stream, event._seq))

    def wait_stream(self, stream: object) -> None:
        with LOCK:
            if isinstance(stream, SimStream) and stream is not self:
                self._enqueue(_Dep(_next_seq(), stream, _last_seq))

    def record_event(self, event: SimEvent | None = None) -> SimEvent:
        event = event if event is not None else SimEvent()
        event.record(self)
        return event

    def __enter__(self) -> SimStream:
        _TLS.__dict__.setdefault("saved", []).append(getattr(_TLS, "stream", None))
        _TLS.stream = self
        return self

    def __exit__(self, *exc: object) -> None:
        _TLS.stream = _TLS.saved.pop()


_TLS = threading.local()
DEFAULT_STREAM = SimStream()


def current_stream(device: object = None) -> SimStream:
    return getattr(_TLS, "stream", None) or DEFAULT_STREAM


def default_stream(device: object = None) -> SimStream:
    return DEFAULT_STREAM


class SimStreamContext:
    """``torch.cuda.stream(s)``: ``s`` is this thread's current stream inside (None or a foreign stream: no-op).
    Reusable, like torch's ``StreamContext`` (SGLang makes one per scheduler and enters it for every batch)."""

    def __init__(self, s: object) -> None:
        self.stream = s if isinstance(s, SimStream) else None

    def __enter__(self) -> SimStream | None:
        if self.stream is not None:
            self.stream.__enter__()
        return self.stream

    def __exit__(self, *exc: object) -> None:
        if self.stream is not None:
            self.stream.__exit__()


def stream(s: object) -> SimStreamContext:
    return SimStreamContext(s)


def synchronize(device: object = None) -> None:
    """``torch.cuda.synchronize()``: every stream's queued work lands."""
    note_sync("device_sync", land=False)
    land_everything("device_sync")


def device_synchronize(device: object = None) -> None:
    """The device module's ``synchronize`` (``torch.cpu.synchronize``): ``torch.cuda.synchronize``'s twin as a
    function of its own. torch.compile keeps one handler per synchronize function and refuses to register the same
    function twice (0.4.x compiles the overlap worker's code: every first request failed on that)."""
    synchronize(device)


def land_everything(why: str) -> None:
    with LOCK:
        for s in list(_STREAMS):
            s.land_all(why)


def as_stream(s: object) -> SimStream:
    """A SimStream as given; anything else (None, a ``torch.cpu.Stream``) means this thread's current stream."""
    return s if isinstance(s, SimStream) else current_stream()


class SimEvent:
    """``torch.cuda.Event`` on the CPU testbed: marks a point in a stream's queue."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 **_kwargs: object) -> None:
        self._stream: SimStream | None = None
        self._seq = 0
        self._time: float | None = None

    def record(self, stream: object = None) -> None:
        with LOCK:
            self._stream, self._seq, self._time = as_stream(stream), _last_seq, time.perf_counter()

    def wait(self, stream: object = None) -> None:
        as_stream(stream).wait_event(self)

    def query(self) -> bool:
        """True, and what the event covers lands (a GPU that answers True has finished it); not a counted sync."""
        if self._stream is not None:
            self._stream.land_upto(self._seq, "event_query")
        return True

    def synchronize(self) -> None:
        if self._stream is None:
            return  # never recorded: CUDA returns at once
        note_sync("event_sync", land=False)
        self._stream.land_upto(self._seq, "event_sync")

    def elapsed_time(self, end_event: SimEvent) -> float:
        if self._time is None or end_event._time is None:
            raise RuntimeError("elapsed_time: both events must be recorded (sglang_harden CUDA simulator)")
        return (end_event._time - self._time) * 1000.0

    @property
    def cuda_event(self) -> int:
        return id(self)


def enqueue_d2h(dst: Any, snapshot: Any) -> None:
    """``dst`` (pinned host memory) receives ``snapshot`` when the host next waits for the current stream; until
    then it holds the poison value. Counted per (owner, site); a copy of no bytes (nothing to read early) is
    counted at its site + " [empty]"."""
    key, start, end = span(dst)
    with torch._C.DisableTorchFunction():
        dst.fill_(poison_value(dst.dtype))
    s = current_stream()
    owner, site = caller() or ("other", "?")
    with LOCK:
        STATS.async_copies[(owner, site if end > start else site + " [empty]")] += 1
        PENDING.setdefault(key, []).append((start, end))
        s._enqueue(_Copy(_next_seq(), dst, snapshot, key, (start, end)))


# ------------------------------------------------------------------------------------- process-wide patches

CUDA_NAMES = ("Event", "Stream", "current_stream", "default_stream", "stream", "synchronize")
# SGLang reaches the device's streams through ``torch.get_device_module(device)``, which is ``torch.cpu`` for the
# simulated device (its type is "cpu"): these are the simulator's too where the mode runs (the scheduler process).
DEVICE_MODULE_NAMES = ("Event", "Stream", "current_stream", "stream", "synchronize")
_REPLACEMENTS: dict[str, object] = {"Event": SimEvent, "Stream": SimStream, "current_stream": current_stream,
                                    "default_stream": default_stream, "stream": stream, "synchronize": synchronize}
PINNING_FACTORIES = ("empty", "zeros", "ones", "full", "empty_strided", "tensor", "arange", "rand", "randn",
                     "randint", "empty_like", "zeros_like", "ones_like", "full_like")
READ_CHECKED_METHODS = ("numpy", "tolist", "item")
_saved: list[tuple[object, str, object]] = []  # (owner, name, original) of every patch, in order


def _patch(owner: object, name: str, value: object) -> None:
    _saved.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def _pinning(original: Callable[..., Any]) -> Callable[..., Any]:
    def factory(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
            return mark_pinned(original(*args, **kwargs))
        return original(*args, **kwargs)

    factory.__name__ = getattr(original, "__name__", "factory")
    factory.__wrapped__ = original  # type: ignore[attr-defined]
    return factory


def _pin_memory(self: Any, device: object = None) -> Any:
    if is_pinned(self):
        return self
    with torch._C.DisableTorchFunction():
        return mark_pinned(self.clone())


def _is_pinned(self: Any, device: object = None) -> bool:
    return is_pinned(self)


def _read_checked(original: Callable[..., Any], op: str) -> Callable[..., Any]:
    """A host read on a thread without the mode (the transfer worker) still sees a copy in flight."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if PENDING and threading.get_ident() not in MODED_THREADS and pending_read(self):
            note_poisoned_read(op)
        return original(self, *args, **kwargs)

    method.__name__ = op
    return method


def install_process() -> bool:
    """Install the stream/event replacements, pinned memory and off-thread read checks in this process (once).
    ``torch.cuda.is_available()`` is left alone (False), so SGLang keeps its CPU paths. True when installed now."""
    with LOCK:
        if _saved:
            return False
        for name in CUDA_NAMES:
            _patch(torch.cuda, name, _REPLACEMENTS[name])
        for name in PINNING_FACTORIES:
            _patch(torch, name, _pinning(getattr(torch, name)))
        _patch(torch.Tensor, "pin_memory", _pin_memory)
        _patch(torch.Tensor, "is_pinned", _is_pinned)
        for name in READ_CHECKED_METHODS:
            _patch(torch.Tensor, name, _read_checked(getattr(torch._C.TensorBase, name), name))
        return True


_device_module_saved: list[tuple[object, str, object]] = []


def install_device_module(module: Any = None) -> None:
    """The simulated device's module (``torch.cpu``): its streams and events are the simulator's (once)."""
    module = module if module is not None else torch.cpu
    with LOCK:
        if _device_module_saved:
            return
        for name in DEVICE_MODULE_NAMES:
            _device_module_saved.append((module, name, getattr(module, name)))
            setattr(module, name, device_synchronize if name == "synchronize" else _REPLACEMENTS[name])


def uninstall_device_module() -> None:
    with LOCK:
        while _device_module_saved:
            owner, name, original = _device_module_saved.pop()
            setattr(owner, name, original)


def uninstall_process() -> None:
    """Undo ``install_process`` (in-process tests); every queued copy lands first."""
    with LOCK:
        land_everything("uninstall")
        while _saved:
            owner, name, original = _saved.pop()
            setattr(owner, name, original)


def installed() -> bool:
    return bool(_saved)



register_sim_file(note_sync.__code__.co_filename)
