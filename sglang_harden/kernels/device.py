"""Device work the guards launch without ever making the host wait for a GPU stream.

The scheduler thread of an SGLang server runs one step ahead of the GPU (the overlap scheduler): any host
synchronisation with a CUDA stream -- ``.item()``, ``.tolist()``, ``.cpu()``, a blocking copy, ``nonzero``,
``torch.cuda.synchronize()`` -- costs the rest of the forward in flight. So a guard that needs a value a device
tensor holds asks for it in advance and reads it later:

* :class:`HostCopy` copies device tensors into pinned host memory with ``non_blocking=True`` on a stream and
  records an event after the copy; :meth:`HostCopy.ready` asks the event (``query()``, which never blocks) and only
  then may the host read :meth:`HostCopy.numpy`. Reading earlier would read whatever the pinned buffer held before.
* :func:`side_stream` is a private high-priority stream per device: short kernels the guards launch (stamps,
  checks, digests) run there without queueing behind the model's forward.
* :func:`upload` moves a host array to the device from pinned memory without a blocking copy.

On a CPU tensor everything is immediate: :class:`HostCopy` holds a copy of the values at once (nothing can be in
flight on the CPU). Whether a tensor lives on an accelerator is :func:`on_accelerator`; the CPU testbed's CUDA
simulator (``sglang_harden/testbed/cudasim.py``) answers it for the tensors it treats as device tensors
(:func:`simulate_accelerator`), so the same code path runs in its tests as on a GPU.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

HOST_DEVICE_TYPES = ("cpu", "meta")
HIGH_PRIORITY = -1  # CUDA stream priorities: lower is higher

_probe: Callable[[Any], bool] | None = None
_streams: dict[str, Any] = {}
_streams_lock = threading.Lock()


def on_accelerator(tensor: Any) -> bool:
    """Whether ``tensor`` lives on a GPU (reading it on the host would synchronise with a stream)."""
    probe = _probe
    if probe is not None:
        return probe(tensor)
    device = getattr(tensor, "device", "cpu")  # numpy arrays name theirs with a string
    return getattr(device, "type", device) not in HOST_DEVICE_TYPES


def simulate_accelerator(probe: Callable[[Any], bool] | None) -> None:
    """The CPU testbed's CUDA simulator: ``probe(tensor)`` says which CPU tensors stand for device tensors (None:
    back to the real answer)."""
    global _probe
    _probe = probe


def _cuda() -> Any:
    import torch

    return torch.cuda


def side_stream(device: Any) -> Any:
    """A private high-priority stream on ``device``'s GPU, made once per device."""
    key = str(device)
    stream = _streams.get(key)
    if stream is None:
        with _streams_lock:
            stream = _streams.get(key)
            if stream is None:
                stream = _streams[key] = _cuda().Stream(priority=HIGH_PRIORITY)
    return stream


class HostCopy:
    """Device tensors copied to pinned host memory without the host waiting; read once :meth:`ready`.

    ``launch(tensors, stream)`` queues the copies on ``stream`` (default: the current stream, so they are
    ordered after whatever produced the tensors) and records an event after them. For CPU tensors the copy is
    made at once and the result is ready."""

    def __init__(self, host: list[Any], event: Any = None) -> None:
        self._host = host
        self._event = event

    @classmethod
    def launch(cls, tensors: Sequence[Any], stream: Any = None) -> HostCopy:
        import torch

        if not tensors or not on_accelerator(tensors[0]):
            return cls([t.detach().clone() for t in tensors])
        cuda = _cuda()
        stream = stream if stream is not None else cuda.current_stream()
        host = []
        with cuda.stream(stream):
            for tensor in tensors:
                pinned = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
                pinned.copy_(tensor, non_blocking=True)
                host.append(pinned)
            event = cuda.Event()
            event.record(stream)
        return cls(host, event)

    def __len__(self) -> int:
        return len(self._host)

    def ready(self) -> bool:
        """Whether the copies landed (asks the event; never blocks)."""
        if self._event is None:
            return True
        if self._event.query():
            self._event = None
            return True
        return False

    def wait(self) -> None:
        """Block until the copies landed: a host synchronisation, for rare paths only (callers say why)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None

    def numpy(self, index: int = 0) -> Any:
        """The ``index``-th copied tensor as a numpy array (only once :meth:`ready`)."""
        if self._event is not None:
            raise RuntimeError("HostCopy read before its copy landed (call ready() first)")
        return self._host[index].numpy()

    def tensor(self, index: int = 0) -> Any:
        if self._event is not None:
            raise RuntimeError("HostCopy read before its copy landed (call ready() first)")
        return self._host[index]


class LandingQueue:
    """Copies applied in the order they were made, each once it landed: what a page ledger learns of the frees it
    did not read (``apply(numpy array)``)."""

    def __init__(self) -> None:
        self.copies: list[HostCopy] = []

    def __len__(self) -> int:
        return len(self.copies)

    def add(self, copy: HostCopy) -> None:
        self.copies.append(copy)

    def drain(self, apply: Callable[[Any], None], wait: bool = False) -> None:
        """Apply the copies that landed, in order, up to the first that has not (``wait``: all of them, waiting: a
        host synchronisation, for rare paths)."""
        while self.copies:
            copy = self.copies[0]
            if not copy.ready():
                if not wait:
                    return
                copy.wait()
            self.copies.pop(0)
            apply(copy.numpy())


def upload(array: Any, like: Any, dtype: Any = None) -> Any:
    """``array`` (numpy) as a tensor on ``like``'s device: from pinned memory, without a blocking copy."""
    import torch

    host = torch.from_numpy(array)
    if dtype is not None:
        host = host.to(dtype)
    if not on_accelerator(like):
        return host.to(like.device)
    return host.pin_memory().to(like.device, non_blocking=True)


def record_after_current(device: Any) -> Any:
    """An event recorded on the current stream of ``device`` (for a side stream to wait on)."""
    cuda = _cuda()
    event = cuda.Event()
    event.record(cuda.current_stream(device))
    return event


class EventThen:
    """An event (SGLang's, passed along) that runs ``then`` once it is seen complete, on whichever thread sees it
    first: a ``synchronize()`` that returned, or a ``query()`` that answered True. Everything else is the event's."""

    def __init__(self, event: Any, then: Callable[[], None]) -> None:
        self._event, self._then = event, then

    def synchronize(self) -> None:
        self._event.synchronize()
        self._then()

    def query(self) -> bool:
        done = bool(self._event.query())
        if done:
            self._then()
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._event, name)
