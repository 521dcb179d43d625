"""CPU-only test shims, loaded only in processes the testbed starts (this folder is put on their PYTHONPATH).

Which shims run is chosen by ``SGLANG_HARDEN_TESTBED_SHIMS`` (comma-separated names, from ``ci/pins.toml``).
Every shim is small, named, and acts through a post-import hook, so it patches the module in whichever
process imports it (SGLang spawns its scheduler and detokenizer; they inherit the environment and load
this file too). None of this is product code: it makes GPU-only corners of SGLang run on a CPU box.

The read-only pool reporter (``sglang_harden_poolreport``) always runs: ``/get_server_info`` shows each
scheduler's KV allocator occupancy, so tests can check that a node is back to full capacity.
``SGLANG_HARDEN_TESTBED_KVTRACE_DIR`` additionally turns on the white-box KV tracer (``sglang_harden_kvtrace``),
``SGLANG_HARDEN_TESTBED_WIRETAP_DIR`` the side-channel tap (``sglang_harden_wiretap``: rank ports, what is sent).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

try:
    from sglang_harden._importhook import when_imported
except ImportError:
    # Not installed in this interpreter (a patched image's stand-in): load the checkout's hook module by its
    # path under a name of its own, so that sglang_harden stays unimportable there, as it is in the image.
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "sglang_harden_testbed_importhook", Path(__file__).resolve().parents[2] / "_importhook.py")
    assert _spec is not None and _spec.loader is not None
    _hook = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _hook
    _spec.loader.exec_module(_hook)
    when_imported = _hook.when_imported

SHIMS: dict[str, Callable[[], None]] = {}


def shim(func: Callable[[], None]) -> Callable[[], None]:
    SHIMS[func.__name__] = func
    return func


def _raise_stub(name: str) -> Callable[..., object]:
    def stub(*_args: object, **_kwargs: object) -> object:
        raise NotImplementedError(f"{name} is a CPU test stub (sglang_harden testbed); it must not be called")

    stub.__name__ = name
    return stub


# ------------------------------------------------------------------------------------------- stub modules


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves tiny stand-in modules that expose exactly the listed names (others raise ImportError)."""

    def __init__(self) -> None:
        self.modules: dict[str, set[str]] = {}

    def add(self, module: str, names: set[str]) -> None:
        self.modules.setdefault(module, set()).update(names)
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def find_spec(self, fullname: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.modules:
            return None
        is_pkg = any(m.startswith(fullname + ".") for m in self.modules)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=is_pkg)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        names = self.modules[module.__name__]
        for name in names:
            setattr(module, name, _raise_stub(f"{module.__name__}.{name}"))
        if module.__spec__ is not None and module.__spec__.submodule_search_locations is not None:
            module.__path__ = []

        def __getattr__(name: str) -> object:
            raise AttributeError(f"{module.__name__}.{name} (CPU test stub provides only {sorted(names)})")

        module.__getattr__ = __getattr__  # type: ignore[method-assign]


_stubs = _StubFinder()

SGL_KERNEL_CPU_NAMES = {
    "copy_all_layer_kv_cache_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
}


@shim
def sgl_kernel_cpu_stub() -> None:
    """The CUDA ``sgl_kernel`` cannot load here; SGLANG_USE_CPU_ENGINE imports these names from it."""
    _stubs.add("sgl_kernel", SGL_KERNEL_CPU_NAMES)


@shim
def sgl_kernel_kvcacheio_stub() -> None:
    """0.4.x imports the KV-cache I/O kernels at module level."""
    _stubs.add("sgl_kernel", set())
    # 0.4.10 imports the whole host-cache family in memory_pool_host.py (used only with --enable-hierarchical-cache)
    _stubs.add("sgl_kernel.kvcacheio", {
        "transfer_kv_per_layer", "transfer_kv_per_layer_mla", "transfer_kv_all_layer", "transfer_kv_all_layer_lf_pf",
        "transfer_kv_all_layer_mla", "transfer_kv_all_layer_mla_lf_pf", "transfer_kv_direct",
        "transfer_kv_per_layer_mla_pf_lf", "transfer_kv_per_layer_pf_lf"})


@shim
def sgl_kernel_kvcacheio_stub_0510() -> None:
    """0.5.10's memory_pool_host.py imports the whole KV-cache I/O family at module level (used only with
    --enable-hierarchical-cache); 0.5.1x guards that import behind CUDA."""
    _stubs.add("sgl_kernel", set())
    _stubs.add("sgl_kernel.kvcacheio", {
        "transfer_kv_all_layer", "transfer_kv_all_layer_direct_lf_pf", "transfer_kv_all_layer_lf_pf",
        "transfer_kv_all_layer_lf_ph", "transfer_kv_all_layer_mla", "transfer_kv_all_layer_mla_lf_pf",
        "transfer_kv_direct", "transfer_kv_per_layer", "transfer_kv_per_layer_direct_pf_lf",
        "transfer_kv_per_layer_mla", "transfer_kv_per_layer_mla_pf_lf", "transfer_kv_per_layer_pf_lf",
        "transfer_kv_per_layer_ph_lf"})


@shim
def vllm_custom_ops_stub() -> None:
    """0.4.x imports ``vllm._custom_ops.scaled_fp8_quant``; stub only that (a whole fake vllm misleads SGLang)."""
    _stubs.add("vllm", set())
    _stubs.add("vllm._custom_ops", {"scaled_fp8_quant"})


# ---------------------------------------------------------------------------------------------- torch


def _patch_register_fake(library: ModuleType) -> None:
    original = library.register_fake
    if getattr(original, "_sglang_harden_shim", False):
        return

    def register_fake(op_name: object, *args: object, **kwargs: object) -> object:
        if not (isinstance(op_name, str) and op_name.startswith("torchvision::")):
            return original(op_name, *args, **kwargs)
        try:
            result = original(op_name, *args, **kwargs)
        except Exception:  # torchvision's C ops did not load under CPU torch: skip their fake kernels
            return lambda func=None, /: func
        if not callable(result):
            return result

        def apply(func: object = None, /) -> object:
            try:
                return result(func)
            except Exception:
                return func

        return apply

    register_fake._sglang_harden_shim = True  # type: ignore[attr-defined]
    library.register_fake = register_fake


@shim
def torchvision_register_fake() -> None:
    """PyPI torchvision links CUDA torch; under CPU torch its ``register_fake("torchvision::nms")`` dies."""
    when_imported("torch.library", _patch_register_fake)


def _add_amx_probe(torch: ModuleType) -> None:
    cpu = getattr(torch._C, "_cpu", None)
    if cpu is not None and not hasattr(cpu, "_is_amx_tile_supported"):
        cpu._is_amx_tile_supported = lambda: False


@shim
def amx_probe() -> None:
    """0.4.x calls ``torch._C._cpu._is_amx_tile_supported``, which torch 2.13 removed."""
    when_imported("torch", _add_amx_probe)


# -------------------------------------------------------------------------------------------- mooncake


@shim
def mooncake_tcp() -> None:
    """0.5.x reads MOONCAKE_PROTOCOL; default it to tcp (set by the testbed too)."""
    os.environ.setdefault("MOONCAKE_PROTOCOL", "tcp")


def _patch_engine_protocol(module: ModuleType) -> None:
    cls = getattr(module, "MooncakeTransferEngine", None)
    if cls is None or getattr(cls.initialize, "_sglang_harden_shim", False):
        return

    def initialize(self: object, hostname: str, device_name: str | None) -> None:
        protocol = os.environ.get("MOONCAKE_PROTOCOL", "tcp")
        ret = self.engine.initialize(hostname, "P2PHANDSHAKE", protocol, device_name or "")  # type: ignore[attr-defined]
        if ret != 0:
            raise RuntimeError("Mooncake Transfer Engine initialization failed (testbed tcp shim).")

    initialize._sglang_harden_shim = True  # type: ignore[attr-defined]
    cls.initialize = initialize


@shim
def mooncake_tcp_04x() -> None:
    """0.4.x hard-codes "rdma" in ``MooncakeTransferEngine.initialize``."""
    when_imported("sglang.srt.disaggregation.mooncake.transfer_engine", _patch_engine_protocol)


def _local_ip() -> str:
    return os.environ.get("SGLANG_HOST_IP", "127.0.0.1")


def _patch_local_ip(module: ModuleType) -> None:
    for name in ("get_local_ip_auto", "get_local_ip_by_remote"):
        if hasattr(module, name):
            setattr(module, name, _local_ip)


@shim
def host_ip_04x() -> None:
    """0.4.x ignores SGLANG_HOST_IP and binds the machine's external interface."""
    for mod in ("mooncake.conn", "common.conn", "nixl.conn"):
        when_imported(f"sglang.srt.disaggregation.{mod}", _patch_local_ip)


@shim
def cuda_sim() -> None:
    """The CUDA simulator (``sglang_harden.testbed.cudasim``): ``torch.cuda`` streams and events, pinned memory and
    asynchronous device->host copies in every process, device marks and sync counts on the scheduler thread. SGLang's
    asynchronous GPU paths run as on a GPU (0.5.21+: page indices copied into pinned memory with an event the transfer
    worker waits on; early send's event) and a read before the wait shows (``sglang_harden_cudasim``)."""
    import sglang_harden_cudasim

    sglang_harden_cudasim.install()


# ------------------------------------------------------------------------------------------------ nixl


def _patch_nixl_kinds(module: ModuleType) -> None:
    original = getattr(module, "_normalize_kv_mem_kinds", None)
    if original is None or getattr(original, "_sglang_harden_shim", False):
        return

    def normalize(*args: object, **kwargs: object) -> list[str]:
        return ["DRAM" if kind == "VRAM" else kind for kind in original(*args, **kwargs)]

    normalize._sglang_harden_shim = True  # type: ignore[attr-defined]
    module._normalize_kv_mem_kinds = normalize


@shim
def nixl_vram_as_dram() -> None:
    """SGLang labels the CPU KV pool 'VRAM'; UCX without CUDA refuses to register it as such."""
    when_imported("sglang.srt.disaggregation.nixl.conn", _patch_nixl_kinds)


# ------------------------------------------------------------------------------------------------ main


def install(names: list[str]) -> None:
    unknown = [n for n in names if n not in SHIMS]
    if unknown:
        raise RuntimeError(f"unknown testbed shim(s) {unknown}; known: {sorted(SHIMS)}")
    for name in names:
        SHIMS[name]()


def _main() -> None:
    names = [n for n in os.environ.get("SGLANG_HARDEN_TESTBED_SHIMS", "").split(",") if n]
    install(names)
    import sglang_harden_poolreport

    sglang_harden_poolreport.install()
    if os.environ.get("SGLANG_HARDEN_TESTBED_KVTRACE_DIR"):
        import sglang_harden_kvtrace

        sglang_harden_kvtrace.install()
    if os.environ.get("SGLANG_HARDEN_TESTBED_WIRETAP_DIR"):
        import sglang_harden_wiretap

        sglang_harden_wiretap.install()
    if os.environ.get("SGLANG_HARDEN_TESTBED_LATE_WRITE"):
        import sglang_harden_latewrite

        sglang_harden_latewrite.install()
    if os.environ.get("SGLANG_HARDEN_TESTBED_ABORT_BEFORE_SEND"):
        import sglang_harden_abortsend

        sglang_harden_abortsend.install()
    if any(os.environ.get(f"SGLANG_HARDEN_TESTBED_{name}") for name in ("STALL_DECODE", "STALL_PREFILL",
                                                                         "DELAY_SUCCESS_SYNC")):
        import sglang_harden_stall

        sglang_harden_stall.install()
    if os.environ.get("SGLANG_HARDEN_TESTBED_KV_FAULT"):
        import sglang_harden_kvfault

        sglang_harden_kvfault.install()
    if os.environ.get("SGLANG_HARDEN_TESTBED_MISOWN_ROOM"):
        import sglang_harden_misown

        sglang_harden_misown.install()
    if os.environ.get("SGLANG_HARDEN_TESTBED_BREAK_HOOK"):
        import sglang_harden_breakhook

        sglang_harden_breakhook.install()
    if os.environ.get("SGLANG_HARDEN_TESTBED_DELEGATING_FINDER"):  # last: placed next to sglang-harden's finder
        import sglang_harden_delegating_finder

        sglang_harden_delegating_finder.install()


_main()
