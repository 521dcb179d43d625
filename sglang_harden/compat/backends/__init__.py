"""Transfer backends the page lifecycle, page-tag and canary guards feed from, one module each, all with one
small interface:

  ``MODULE``     the backend's connection module (``compat/internals.backend_module(name)``);
  ``RECEIVER``   decode's receiver class, whose ``send_metadata(kv_indices, ...)`` hands the request's pages to the
                 writer (the ledger reserves them there, the canary stamps them);
  ``HOOKS``      its lifecycle hooks: the manager's ``add_transfer_request`` (prefill holds the chunk's source
                 pages), how a failed or abandoned write shows up (``PrefillNode.note_failed_write``), any
                 abort-notice path that drops a drain-ack target, and the transfer window where it has one.

Adding a backend: its module here, its name in ``BACKENDS``, a test file; the hook tables take the rest from
``lifecycle_hooks`` and ``receiver_hooks``. A release whose backend lacks a required hook (MORI before 0.5.22: no
drain acks) refuses to start while a guard that needs the backend is armed, naming the hook.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType

from sglang_harden.compat.hooks import Hook
from sglang_harden.compat.internals import backend_module

BACKENDS = ("mooncake", "nixl", "mori")
BACKEND_MODULES = {name: backend_module(name) for name in BACKENDS}
MOONCAKE, NIXL, MORI = (BACKEND_MODULES[name] for name in BACKENDS)


def backend_modules() -> list[ModuleType]:
    """The backends' adapter modules (imported on first use: each imports the lifecycle hooks it reuses)."""
    return [importlib.import_module(f"{__name__}.{name}") for name in BACKENDS]


def lifecycle_hooks() -> list[Hook]:
    return [hook for module in backend_modules() for hook in module.HOOKS]


def receiver_hooks(owner: str, make_wrapper: Callable[..., object]) -> list[Hook]:
    """``owner``'s hook on every backend receiver's ``send_metadata`` (decode's pages leave this node there)."""
    return [Hook(owner, module.MODULE, f"{module.RECEIVER}.send_metadata", ("self", "kv_indices"), make_wrapper)
            for module in backend_modules()]


def receiver_poll_hooks(owner: str, make_wrapper: Callable[..., object]) -> list[Hook]:
    """``owner``'s hook on every backend receiver's ``poll`` (decode learns there that a transfer finished). Up to
    0.5.21 each receiver class has its own ``poll``; from 0.5.22 some inherit ``CommonKVReceiver``'s, which the
    hook then wraps on the receiver class itself."""
    return [Hook(owner, module.MODULE, f"{module.RECEIVER}.poll", ("self",), make_wrapper)
            for module in backend_modules()]


def needed_on_backend(hook: Hook, backend: str) -> bool:
    """A hook into one transfer backend's module is needed only in processes that use that backend."""
    return hook.module not in BACKEND_MODULES.values() or hook.module == BACKEND_MODULES.get(backend)


def check_backend(role: str, backend: str, needs_backend: list[str]) -> str | None:
    """Why the guards in ``needs_backend`` (those armed here that read a backend's ledger hooks) cannot run on
    ``backend`` (None: they can)."""
    if role not in ("prefill", "decode") or not needs_backend or backend in BACKEND_MODULES:
        return None
    flags = " and ".join(f"--harden-{guard.replace('_', '-')} off" for guard in needs_backend)
    return (f"sglang-harden {', '.join(needs_backend)} support the {'/'.join(BACKEND_MODULES)} transfer backends, "
            f"not {backend!r}; use one of those or start with {flags} (the page ledger then does not guard "
            "against late writes or mis-owned pages)")
