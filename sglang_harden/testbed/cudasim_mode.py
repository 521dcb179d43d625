"""The CUDA simulator's torch-function mode (test-only): pushed on one thread (SGLang's scheduler), it decides which
tensors live on the simulated device, counts the host synchronisations a GPU would make there, and turns device->host
copies into pinned memory with ``non_blocking=True`` into copies in flight (``cudasim_streams``).

Marks. A result is a device tensor when a factory got ``device=`` a ``SimDevice``, or any tensor input (also inside
a list argument) is one -- except the materialising and device->host ops, whose results are host tensors. On CPU
``t.cpu()`` and ``t.to("cpu")`` return ``t`` itself; for a device tensor the mode returns a real host copy, as CUDA
does. ``t.device`` of a device tensor is the ``SimDevice``, so ``torch.empty(n, device=t.device)`` stays on it.

``is_cuda`` stays False (SGLang keeps its CPU paths) except, with ``SGLANG_HARDEN_TESTBED_CUDASIM_CUDA_FOR``, to the
callers of the owners it lists.

Counted (kind): ``item``, ``tolist``, ``numpy`` (``.numpy()``/``__array__`` of a device tensor also raise
TypeError, as on CUDA), ``scalar`` (bool/int/float/index/complex), ``repr``, ``d2h`` (``.cpu()``, ``.to(host)``,
a blocking ``copy_``/``__setitem__`` into host memory), ``h2d`` (a blocking host->device copy: a factory with data,
``.to(device)``, ``copy_`` without ``non_blocking``), ``dynamic_shape`` (nonzero, argwhere, unique,
unique_consecutive, masked_select, boolean-mask indexing/assignment/index_put, one-argument where,
repeat_interleave with tensor repeats), ``compare`` (equal, allclose).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from sglang_harden.testbed import cudasim_core as core
from sglang_harden.testbed.cudasim_core import SimDevice, is_device, mark_device
from sglang_harden.testbed.cudasim_streams import SimStream, enqueue_d2h, note_sync

# Owners (comma-separated: sglang_harden, sglang, other) to whom a device tensor answers ``is_cuda`` True, so that
# their GPU-only branches run (e.g. sglang_harden's canary stamp synchronises the device only when the KV pool
# ``is_cuda``). Empty by default: SGLang must keep its CPU paths.
CUDA_FOR_ENV = "SGLANG_HARDEN_TESTBED_CUDASIM_CUDA_FOR"
Handler = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]
Tensor = torch.Tensor
_BOOL_DTYPES = (torch.bool, torch.uint8)

# Methods and properties that read no tensor data (metadata, views, pure writes): no poisoned read.
META_METHODS = ("__len__", "size", "dim", "numel", "nelement", "stride", "storage_offset", "data_ptr",
                "untyped_storage", "storage", "is_contiguous", "element_size", "is_floating_point", "is_complex",
                "get_device", "__hash__", "record_stream", "is_pinned", "pin_memory")
VIEW_METHODS = ("view", "view_as", "as_strided", "narrow", "select", "unsqueeze", "squeeze", "t", "transpose",
                "permute", "expand", "expand_as", "detach", "unbind", "split", "chunk", "reshape", "flatten",
                "unflatten", "fill_", "zero_")
META_PROPERTIES = ("shape", "dtype", "is_cpu", "ndim", "layout", "requires_grad", "grad", "grad_fn",
                   "is_leaf", "_base", "names", "itemsize", "nbytes", "is_sparse", "is_quantized", "is_meta",
                   "output_nr", "_version", "is_mps", "is_xpu", "is_nested")


def _marked_in(items: Iterable[Any]) -> bool:
    for a in items:
        if isinstance(a, Tensor):
            if is_device(a):
                return True
        elif isinstance(a, list | tuple):
            for b in a:
                if isinstance(b, Tensor) and is_device(b):
                    return True
    return False


def _mark(out: Any) -> Any:
    if isinstance(out, Tensor):
        mark_device(out)
    elif isinstance(out, list | tuple):
        for o in out:
            if isinstance(o, Tensor):
                mark_device(o)
    return out


def _check_reads(op: Any, items: Iterable[Any]) -> None:
    for a in items:
        if isinstance(a, Tensor):
            if core.pending_read(a):
                core.note_poisoned_read(_op_name(op))
                return
        elif isinstance(a, list | tuple):
            for b in a:
                if isinstance(b, Tensor) and core.pending_read(b):
                    core.note_poisoned_read(_op_name(op))
                    return


def _op_name(func: Any) -> str:
    return str(getattr(func, "__name__", None) or func)


def _generic(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if core.PENDING:
        _check_reads(func, args)
    out = func(*args, **kwargs)
    if kwargs:
        device = kwargs.get("device")
        if device is not None:
            return _mark(out) if isinstance(device, SimDevice) else out
        if _marked_in(kwargs.values()):
            return _mark(out)
    return _mark(out) if _marked_in(args) else out


def _view(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    out = func(*args, **kwargs)
    return _mark(out) if args and is_device(args[0]) else out


def _passthrough(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return func(*args, **kwargs)


def _materialising(kind: str) -> Handler:
    def handler(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        t = args[0]
        if is_device(t):
            note_sync(kind)
        elif core.PENDING and core.pending_read(t):
            core.note_poisoned_read(_op_name(func))
        return func(*args, **kwargs)

    return handler


NUMPY_ERROR = ("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to host memory "
               "first. (sglang_harden CUDA simulator: this tensor lives on the simulated device)")


def _numpy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    t = args[0]
    if is_device(t):
        note_sync("numpy")
        raise TypeError(NUMPY_ERROR)
    if core.PENDING and core.pending_read(t):
        core.note_poisoned_read(_op_name(func))
    return func(*args, **kwargs)


def _host_copy(t: Tensor, out: Any) -> Any:
    return t.clone() if out is t else out


def _cpu(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    t = args[0]
    if not is_device(t):
        return func(*args, **kwargs)
    note_sync("d2h")
    return _host_copy(t, func(*args, **kwargs))


def _target(value: Any) -> str | None:
    """'device' | 'host' | None (not a device)."""
    if isinstance(value, SimDevice):
        return "device"
    if isinstance(value, str | torch.device):
        return "host"
    if isinstance(value, Tensor):
        return "device" if is_device(value) else "host"
    return None


def _parse_to(rest: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str | None, bool]:
    target = _target(kwargs["device"]) if kwargs.get("device") is not None else None
    non_blocking = bool(kwargs.get("non_blocking", False))
    for a in rest:
        if isinstance(a, bool):
            non_blocking = a
            break
        found = _target(a)
        if found is not None:
            target = found
    return target, non_blocking


def _to(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    t = args[0]
    target, non_blocking = _parse_to(args[1:], kwargs)
    if target is None:
        return _generic(func, args, kwargs)
    src_device = is_device(t)
    if core.PENDING and not src_device and core.pending_read(t):
        core.note_poisoned_read("to")
    out = func(*args, **kwargs)
    if target == "device":
        if not src_device:
            if not non_blocking:
                note_sync("h2d")
            out = _host_copy(t, out)
        return _mark(out)
    if not src_device:
        return out
    out = _host_copy(t, out)
    if non_blocking:  # CUDA gives a pinned destination; it holds the data once the host waits for the stream
        dst = core.mark_pinned(torch.empty_like(out))
        enqueue_d2h(dst, out)
        return dst
    note_sync("d2h")
    return out


def _copy(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    dst, src = args[0], args[1]
    non_blocking = bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
    dst_device, src_device = is_device(dst), isinstance(src, Tensor) and is_device(src)
    if core.PENDING and not src_device and core.pending_read(src):
        core.note_poisoned_read("copy_")
    if src_device and not dst_device:
        if non_blocking and core.is_pinned(dst):
            with torch._C.DisableTorchFunction():
                snapshot = src.detach().clone()
            enqueue_d2h(dst, snapshot)
            return dst
        note_sync("d2h")
    elif dst_device and not src_device and isinstance(src, Tensor) and not non_blocking:
        note_sync("h2d")
    return func(*args, **kwargs)


def _data_factory(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    device = kwargs.get("device")
    data = args[0] if args else kwargs.get("data")
    from_device = _marked_in((data,))
    if not from_device and core.PENDING:
        _check_reads(func, (data,))
    out = func(*args, **kwargs)
    if isinstance(device, SimDevice):
        if not from_device:
            note_sync("h2d")
            out = _host_copy(data, out) if isinstance(data, Tensor) else out
        return _mark(out)
    if device is not None:
        if from_device:
            note_sync("d2h")
            out = _host_copy(data, out) if isinstance(data, Tensor) else out
        return out
    return _mark(out) if from_device else out


def _new_tensor(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    t, data, device = args[0], (args[1] if len(args) > 1 else kwargs.get("data")), kwargs.get("device")
    to_device = isinstance(device, SimDevice) or (device is None and is_device(t))
    from_device = _marked_in((data,))
    out = func(*args, **kwargs)  # new_tensor always copies
    if to_device:
        if not from_device:
            note_sync("h2d")
        return _mark(out)
    if from_device:
        note_sync("d2h")
    return out


def _is_bool_index(idx: Any) -> bool:
    if isinstance(idx, Tensor):
        return idx.dtype in _BOOL_DTYPES
    if isinstance(idx, tuple | list):
        return any(isinstance(i, Tensor) and i.dtype in _BOOL_DTYPES for i in idx)
    return False


def _is_advanced(idx: Any) -> bool:
    if isinstance(idx, Tensor | list):
        return True
    return isinstance(idx, tuple) and any(isinstance(i, Tensor | list) for i in idx)


def _getitem(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    t, idx = args[0], args[1]
    if not _is_advanced(idx):  # a view: reads nothing
        return _mark(func(t, idx)) if is_device(t) else func(t, idx)
    marked = is_device(t) or _marked_in((idx,))
    if marked and _is_bool_index(idx):
        note_sync("dynamic_shape")
    if core.PENDING:
        _check_reads(func, (t, idx))
    out = func(t, idx)
    return _mark(out) if marked else out


def _setitem(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    t, idx, value = args[0], args[1], args[2]
    dst_device = is_device(t)
    if (dst_device or _marked_in((idx,))) and _is_bool_index(idx):
        note_sync("dynamic_shape")
    if isinstance(value, Tensor):
        if core.PENDING and core.pending_read(value):
            core.note_poisoned_read("__setitem__")
        if not dst_device and is_device(value):
            note_sync("d2h")
    return func(*args, **kwargs)


def _index_put(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    if _is_bool_index(indices) and (_marked_in(args) or _marked_in(kwargs.values())):
        note_sync("dynamic_shape")
    return _generic(func, args, kwargs)


def _sync_if_marked(kind: str, when: Callable[[tuple[Any, ...], dict[str, Any]], bool] | None = None) -> Handler:
    def handler(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if (when is None or when(args, kwargs)) and (_marked_in(args) or _marked_in(kwargs.values())):
            note_sync(kind)
        return _generic(func, args, kwargs)

    return handler


def _where_one_arg(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return len(args) + len(kwargs) == 1


def _tensor_repeats(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if kwargs.get("output_size") is not None:
        return False
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
    return repeats is None or isinstance(repeats, Tensor)  # repeat_interleave(t): t holds the repeats


def _record_stream(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if len(args) > 1 and isinstance(args[1], SimStream):
        return None  # a simulated stream: nothing to keep alive
    return func(*args, **kwargs)


def _tensor_attr(name: str) -> list[Any]:
    """The objects a mode sees as ``func`` for Tensor.<name>: the current attribute (a simulator patch, if any) and
    the C method under it."""
    found = []
    for owner in (torch.Tensor, torch._C.TensorBase):
        value = getattr(owner, name, None)
        if value is not None:
            is_property = isinstance(value, property) or type(value).__name__ == "getset_descriptor"
            found.append(value.__get__ if is_property else value)
    return found


def build_handlers(device: SimDevice) -> dict[Any, Handler]:
    """func -> handler; built after ``cudasim_streams.install_process`` so that its Tensor patches are the keys."""
    table: dict[Any, Handler] = {}

    def put(names: Iterable[str], handler: Handler, torch_too: bool = False) -> None:
        for name in names:
            for func in _tensor_attr(name):
                table[func] = handler
            if torch_too and hasattr(torch._C._VariableFunctions, name):
                table[getattr(torch._C._VariableFunctions, name)] = handler
                table[getattr(torch, name)] = handler

    def device_getter(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return device if is_device(args[0]) else func(*args, **kwargs)

    put(META_METHODS + META_PROPERTIES, _passthrough)
    put(VIEW_METHODS, _view)
    cuda_for = frozenset(o.strip() for o in os.environ.get(CUDA_FOR_ENV, "").split(",") if o.strip())

    def is_cuda_getter(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if cuda_for and is_device(args[0]):
            where = core.caller()
            if where is not None and where[0] in cuda_for:
                return True
        return func(*args, **kwargs)

    put(("device",), device_getter)
    put(("is_cuda",), is_cuda_getter)
    for name, kind in (("item", "item"), ("tolist", "tolist"), ("__bool__", "scalar"), ("__int__", "scalar"),
                       ("__float__", "scalar"), ("__index__", "scalar"), ("__complex__", "scalar"),
                       ("__repr__", "repr"), ("__format__", "repr")):
        put((name,), _materialising(kind))
    put(("numpy", "__array__"), _numpy)
    put(("cpu",), _cpu)
    put(("to",), _to)
    put(("copy_",), _copy)
    put(("new_tensor",), _new_tensor)
    put(("__getitem__",), _getitem)
    put(("__setitem__",), _setitem)
    put(("index_put_", "index_put"), _index_put, torch_too=True)
    put(("record_stream",), _record_stream)
    put(("nonzero", "argwhere", "unique", "unique_consecutive", "masked_select"), _sync_if_marked("dynamic_shape"),
        torch_too=True)
    put(("repeat_interleave",), _sync_if_marked("dynamic_shape", _tensor_repeats), torch_too=True)
    put(("equal", "allclose"), _sync_if_marked("compare"), torch_too=True)
    table[torch._C._VariableFunctions.where] = table[torch.where] = _sync_if_marked("dynamic_shape", _where_one_arg)
    for name in ("tensor", "as_tensor", "asarray"):
        for func in (getattr(torch._C._VariableFunctions, name, None), getattr(torch, name, None)):
            if func is not None:
                table[func] = _data_factory
    for name in ("unique", "unique_consecutive"):  # Python wrappers in torch.functional dispatch as themselves
        table[getattr(torch.functional, name)] = _sync_if_marked("dynamic_shape")
    return table


class SimMode(TorchFunctionMode):
    """Pushed on the scheduler thread only (torch keeps mode stacks per thread)."""

    def __init__(self, device: SimDevice) -> None:
        super().__init__()
        self.device = device
        self.handlers = build_handlers(device)

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        handler = self.handlers.get(func)
        if handler is not None:
            return handler(func, args, kwargs or {})
        return _generic(func, args, kwargs or {})


core.register_sim_file(_generic.__code__.co_filename)
