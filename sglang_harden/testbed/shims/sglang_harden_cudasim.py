"""Shim ``cuda_sim``: run SGLang's asynchronous GPU paths on the CPU testbed under the CUDA simulator (test-only).

Every process: ``torch.cuda.{Event,Stream,current_stream,default_stream,stream,synchronize}``, pinned memory and
asynchronous device->host copies (``sglang_harden.testbed.cudasim``), installed when torch is imported.

Scheduler process: ``Scheduler.__init__`` is wrapped so that before it runs the scheduler thread gets the
simulator's torch-function mode and ``torch.cpu``'s streams and events (the simulated device's module) become the
simulator's, and the device SGLang places its tensors on becomes a ``SimDevice("cpu")``:
``server_args.device`` or, on pins that publish their configuration (0.5.19+, ``sglang.srt.runtime_context``),
the published ``device`` leaf that the model runner reads (``get_device().device``; see ``simulate_device``).
``Scheduler.process_input_requests`` (called once per pass of every event loop) counts loop passes;
``Scheduler.get_internal_state`` adds ``testbed_cudasim`` (``cudasim.report()``) to each ``internal_states[i]`` of
``/server_info`` (``/get_server_info`` on old pins), as ``sglang_harden_poolreport`` adds ``testbed_pool``.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType
from typing import Any

from sglang_harden_shimkit import reporting_state, wrap_methods_once

from sglang_harden._importhook import when_imported

logger = logging.getLogger("sglang_harden.testbed.cudasim")
MARKER = "_sglang_harden_cudasim"


def _install_process(_torch: ModuleType) -> None:
    from sglang_harden.testbed import cudasim

    cudasim.install_process()


def simulate_device(server_args: Any, device: str) -> bool:
    """Make ``device`` (a SimDevice) the device SGLang's scheduler builds on; False when it is not a CPU server.

    0.5.19+ publish the resolved configuration before the scheduler is built and read the device from it
    (``get_device().device``); their ``server_args`` is sealed after resolution, so the published leaf is changed
    the way SGLang allows (``get_context().override(source, device=...)``). Older pins read ``server_args.device``.
    """
    if str(getattr(server_args, "device", "")) != "cpu":
        return False
    try:
        server_args.device = device
    except AttributeError:  # sealed after resolution: the published configuration below is what SGLang reads
        pass
    try:
        from sglang.srt import runtime_context
    except ImportError:  # 0.4.x-0.5.18
        return True
    context = runtime_context.get_context()
    published = getattr(context, "is_config_namespace_published", None)
    if published is not None and published("device"):
        context.override("sglang_harden.testbed.cudasim", device=device)
    return True


def _simulate_in_patched_modules() -> None:
    """A patched tree's sglang-harden modules carry their own copy of ``kernels/device.py``: each is told which
    tensors are device tensors too, now or when it is imported."""
    from sglang_harden.compat.internals import PATCHED_DEVICE_MODULES
    from sglang_harden.testbed import cudasim

    def tell(module: ModuleType) -> None:
        probe = getattr(module, "simulate_accelerator", None)
        if probe is not None:
            probe(cudasim.is_device)

    for name in PATCHED_DEVICE_MODULES:
        when_imported(name, tell)


def _wrap_init(original: Any) -> Any:
    @functools.wraps(original)
    def __init__(self: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
        from sglang_harden.testbed import cudasim

        if str(getattr(server_args, "device", "")) == "cpu":
            device = cudasim.install_mode("cpu")
            simulate_device(server_args, device)
            _simulate_in_patched_modules()
            logger.info("sglang-harden testbed: CUDA simulator on the scheduler thread (device %r)", device)
        original(self, server_args, *args, **kwargs)

    return __init__


# What each pass of the scheduler loop calls once with the requests it took in (every supported pin)
PASS_METHODS = ("process_input_requests", "recv_requests")


def _wrap_pass(original: Any) -> Any:
    @functools.wraps(original)
    def take_requests(self: Any, *args: Any, **kwargs: Any) -> Any:
        from sglang_harden.testbed import cudasim

        cudasim.note_pass()
        return original(self, *args, **kwargs)

    return take_requests


def _simulator_report(scheduler: Any) -> Any:
    from sglang_harden.testbed import cudasim

    return cudasim.report()


def _patch_scheduler(module: ModuleType) -> None:
    wrappers = {"__init__": _wrap_init, "get_internal_state": reporting_state("testbed_cudasim", _simulator_report)}
    passes = next((name for name in PASS_METHODS if hasattr(module.Scheduler, name)), None)
    if passes is not None:
        wrappers[passes] = _wrap_pass
    wrap_methods_once(module.Scheduler, MARKER, wrappers)


def install() -> None:
    when_imported("torch", _install_process)
    when_imported("sglang.srt.managers.scheduler", _patch_scheduler)
