"""A CUDA-semantics simulator for the CPU testbed (test-only code; nothing in the product imports it).

On CPU every tensor is a host tensor and a host sync costs nothing, so a CPU proof cannot see code that reads a
device->host copy before waiting for it, nor count the syncs a guard adds to the scheduler loop. This simulator
runs SGLang's asynchronous GPU paths on CPU and makes both visible:

- Device marks. In the scheduler process the testbed shim (``sglang_harden_cudasim``) replaces
  ``server_args.device`` (and 0.5.19+'s published ``get_device().device``) by a ``SimDevice("cpu")`` -- a ``str``
  torch accepts -- and pushes ``SimMode`` (``cudasim_mode``) on the scheduler thread before ``Scheduler.__init__``.
  Tensors SGLang places on that device, and results computed from them, are "device" tensors (a Python attribute
  on the tensor: measured 54-80 ns to set or test, against 480-1130 ns for ``torch.utils.weak.WeakIdKeyDictionary``).
  Mode stacks are per thread: the transfer worker threads run unmoded, as host code.
- Host syncs, counted per (owner, kind, site) on the moded thread: the reads, copies and data-dependent shapes a
  GPU would wait for (see ``cudasim_mode``), ``torch.cuda.synchronize``, ``Event.synchronize``,
  ``Stream.synchronize``, and (kind ``thread_wait``) ``threading.Event.wait``/``Condition.wait``/
  ``queue.Queue.get(block=True)`` called by sglang_harden's code on that thread.
- Pinned memory and asynchronous copies: ``pin_memory=True`` factories, ``Tensor.pin_memory()`` and
  ``is_pinned()`` work on CPU torch; ``pinned.copy_(device, non_blocking=True)`` and
  ``device.to("cpu", non_blocking=True)`` leave the destination holding a poison value
  (``SGLANG_HARDEN_TESTBED_CUDASIM_POISON``; integers 0 -- SGLang's reserved dummy page --, floats NaN) until the host
  waits for the stream the copy was issued on (``cudasim_streams``); a read before that is a "poisoned read", on any
  thread (the moded one through the mode, others through ``numpy``/``tolist``/``item``).
- sglang-harden's own question "is this tensor on a GPU?" (``sglang_harden.kernels.device.on_accelerator``) is
  answered by the device marks (``simulate_accelerator``), so its GPU code paths run here: streams, pinned copies,
  events polled instead of waited on.
- ``torch.cuda.Event``, ``Stream``, ``current_stream``, ``default_stream``, ``stream``, ``synchronize`` are the
  simulator's (process-wide); ``torch.cuda.is_available()`` stays False so SGLang keeps its CPU paths. Where the
  mode runs (the scheduler process) so are ``torch.cpu.Event``, ``Stream``, ``current_stream``, ``stream`` and
  ``synchronize``: SGLang reaches the device's streams through ``torch.get_device_module(device)``, which is
  ``torch.cpu`` for the simulated device; left alone, 0.5.19's overlap scheduler recorded its ``copy_done`` event on
  ``torch.cpu`` (a no-op), the simulator never landed the copy of the sampled tokens that the event guards, and
  decode read poison (every token after the first was 0).

API: ``install_process()`` (every process), ``install_mode(device)`` (the scheduler thread; returns the
``SimDevice``), ``session()`` (in-process tests: both, on the current thread, undone on exit), ``report()`` (the
``testbed_cudasim`` block of ``/server_info``), ``counts()``, ``reset()``, ``note_pass()``, ``is_device``,
``mark_device``, ``SimDevice``, ``SimStream``, ``SimEvent``.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sglang_harden.kernels import device as accelerator
from sglang_harden.testbed import cudasim_core as core
from sglang_harden.testbed import cudasim_streams as streams
from sglang_harden.testbed.cudasim_core import POISON_ENV, SimDevice, is_device, is_pinned, mark_device, owner_of
from sglang_harden.testbed.cudasim_mode import SimMode
from sglang_harden.testbed.cudasim_streams import SimEvent, SimStream, install_process

__all__ = ["POISON_ENV", "TOP_ENV", "SimDevice", "SimEvent", "SimMode", "SimStream", "counts", "install_mode",
           "install_process", "is_device", "is_pinned", "mark_device", "note_pass", "owner_of", "report", "reset",
           "session"]

TOP_ENV = "SGLANG_HARDEN_TESTBED_CUDASIM_TOP"
_wait_patches: list[tuple[type, str, Callable[..., Any]]] = []


def _waiting(original: Callable[..., Any], blocking: Callable[[tuple[Any, ...], dict[str, Any]], bool]) -> Any:
    def wait(self: Any, *args: Any, **kwargs: Any) -> Any:
        if core.MODED_THREADS and threading.get_ident() in core.MODED_THREADS and blocking(args, kwargs):
            core.note_thread_wait()
        return original(self, *args, **kwargs)

    wait.__name__ = getattr(original, "__name__", "wait")
    return wait


def _always(_args: tuple[Any, ...], _kwargs: dict[str, Any]) -> bool:
    return True


def _queue_blocks(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return bool(args[0] if args else kwargs.get("block", True))


def _install_wait_patches() -> None:
    with core.LOCK:
        if _wait_patches:
            return
        for cls, name, blocking in ((threading.Event, "wait", _always), (threading.Condition, "wait", _always),
                                    (queue.Queue, "get", _queue_blocks)):
            original = getattr(cls, name)
            _wait_patches.append((cls, name, original))
            setattr(cls, name, _waiting(original, blocking))


def _uninstall_wait_patches() -> None:
    with core.LOCK:
        while _wait_patches:
            cls, name, original = _wait_patches.pop()
            setattr(cls, name, original)


def install_mode(device: str = "cpu") -> SimDevice:
    """Push the simulator's mode on the calling thread (for good) and return the simulated device."""
    install_process()
    streams.install_device_module()
    sim = SimDevice(device)
    SimMode(sim).__enter__()
    core.MODED_THREADS.add(threading.get_ident())
    _install_wait_patches()
    accelerator.simulate_accelerator(is_device)
    return sim


@contextmanager
def session(device: str = "cpu", reset_counts: bool = True) -> Iterator[SimDevice]:
    """In-process tests: everything installed, the mode on the current thread; undone on exit (queued copies land)."""
    installed_here = install_process()
    streams.install_device_module()
    if reset_counts:
        reset()
    sim = SimDevice(device)
    ident = threading.get_ident()
    core.MODED_THREADS.add(ident)
    _install_wait_patches()
    accelerator.simulate_accelerator(is_device)
    try:
        with SimMode(sim):
            yield sim
    finally:
        accelerator.simulate_accelerator(None)
        core.MODED_THREADS.discard(ident)
        if not core.MODED_THREADS:
            _uninstall_wait_patches()
            streams.uninstall_device_module()
        if installed_here:
            streams.uninstall_process()
        else:
            streams.land_everything("session_end")


def note_pass() -> None:
    """One pass of the scheduler loop (the shim calls it from ``Scheduler.recv_requests``)."""
    core.STATS.passes += 1


def reset() -> None:
    core.reset_counts()


def counts() -> dict[str, Any]:
    """Raw counts: ``{"syncs": {(owner, kind, site): n}, "poisoned": {(owner, op, site): n}, ...}``."""
    with core.LOCK:
        return {"syncs": dict(core.STATS.syncs), "poisoned": dict(core.STATS.poisoned),
                "async_copies": dict(core.STATS.async_copies), "landed": dict(core.STATS.landed),
                "marked": core.STATS.marked, "passes": core.STATS.passes,
                "pending_copies": sum(len(r) for r in core.PENDING.values())}


def report(top: int | None = None) -> dict[str, Any]:
    """The ``testbed_cudasim`` block of ``/server_info``: totals per owner and kind, the busiest ``top`` sites
    (default ``$SGLANG_HARDEN_TESTBED_CUDASIM_TOP`` or 50)."""
    top = top if top is not None else int(os.environ.get(TOP_ENV) or 50)
    raw = counts()
    syncs: dict[str, dict[str, int]] = {}
    for (owner, kind, _site), n in raw["syncs"].items():
        syncs.setdefault(owner, Counter())[kind] += n  # type: ignore[index]
    poisoned: Counter[str] = Counter()
    for (owner, _op, _site), n in raw["poisoned"].items():
        poisoned[owner] += n
    return {
        "syncs": {owner: dict(kinds) for owner, kinds in syncs.items()},
        "sites": [[*key, n] for key, n in Counter(raw["syncs"]).most_common(top)],
        "poisoned_reads": dict(poisoned),
        "poisoned_sites": [[*key, n] for key, n in Counter(raw["poisoned"]).most_common(top)],
        "async_copies": [[*key, n] for key, n in Counter(raw["async_copies"]).most_common(top)],
        "landed": raw["landed"],
        "marked_tensors_seen": raw["marked"],
        "passes": raw["passes"],
        "pending_copies": raw["pending_copies"],
    }


core.register_sim_file(_waiting.__code__.co_filename)
