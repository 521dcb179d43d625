"""Transfer backends the page lifecycle and page-tag guards feed their ledgers from, one module each.

A backend module (``mooncake.py``, ``nixl.py``) gives the lifecycle hooks of its own SGLang classes: the receiver
whose ``send_metadata`` hands decode's pages to the writer, the manager whose ``add_transfer_request`` queues a
chunk's source pages, and how a failed or abandoned write and a decode abort notice show up there. Everything else
the guards need is common to the backends (``compat/lifecycle_v05.py``). Adding a backend: a module here with its
``HOOKS``, its entry in ``BACKEND_MODULES``, its import in ``compat/sglang_v05.py``, and a test file.
MORI has no module: its drain acks and failure reporting differ per release and it cannot run on the CPU testbed,
so the guards that need a backend refuse to start on it, naming the way out.
"""

from __future__ import annotations

from sglang_harden.compat.hooks import Hook
from sglang_harden.compat.internals import MOONCAKE, NIXL

BACKEND_MODULES = {"mooncake": MOONCAKE, "nixl": NIXL}


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
