"""Native fast paths of the page ledger's per-transfer bulk operations (``ledger_native.c``, next to this file).

A transfer's publish, commit, page-tag check and free each cost one C call here instead of a handful of numpy
calls; numpy's per-call overhead, paid again with cold caches after the KV copy, was most of the ledger's cost
per transfer. Each C function handles only its operation's usual case (every page where the previous step left
it) and otherwise writes nothing and says so: :class:`~sglang_harden.guards.lifecycle.PageLedger` then runs its
numpy path, which applies the same rules to every case. So the C code can only accept what the numpy path would.

The library is a small CPython extension module (METH_FASTCALL functions: the page array is read through the
buffer protocol, the ledger's columns are passed as addresses), because with the caches cold after a KV copy one
ctypes call measured ~40 us and one extension call ~12 us. It is built on first use like the native digest
(:mod:`.native_build`; it needs ``Python.h``); no compiler, no headers, a failed build or
``SGLANG_HARDEN_NATIVE_LEDGER=0``: :func:`ledger_library` returns ``None`` and the ledger stays on numpy.
:func:`native_status` says which and why.
"""

from __future__ import annotations

import sysconfig
import threading
from array import array
from pathlib import Path
from typing import Any

from sglang_harden.kernels.native_build import BASE_FLAGS, import_extension, library_path, load_library

SOURCE = Path(__file__).with_name("ledger_native.c")
DISABLE_ENV = "SGLANG_HARDEN_NATIVE_LEDGER"

# return codes of the C functions
NOT_HANDLED = 0
DONE = 1
MISMATCH = 2

_lock = threading.Lock()
_loaded: dict[str, Any] = {}  # "lib" -> the module or None, "why" -> str

MODULE = "sglang_harden_ledger_native"  # the name PyInit_ in ledger_native.c carries


def _load() -> tuple[Any, str]:
    include = sysconfig.get_paths().get("include") or ""
    flags = (*BASE_FLAGS, f"-I{include}")
    if not Path(include, "Python.h").exists() and not library_path(SOURCE, "ledger", flags).exists():
        return None, f"no Python.h under {include!r} (install the Python development headers) and no library built"
    return load_library(SOURCE, "ledger", DISABLE_ENV, flags, loader=lambda path: import_extension(MODULE, path))


def ledger_library() -> Any:
    """The loaded extension module, building it on first use; ``None`` when unavailable (see native_status)."""
    with _lock:
        if "lib" not in _loaded:
            _loaded["lib"], _loaded["why"] = _load()
        return _loaded["lib"]


def native_status() -> tuple[bool, str]:
    lib = ledger_library()
    return lib is not None, _loaded["why"]


NOT_HANDLED, DONE = 0, 1  # the library's answers to an operation: not its usual case (nothing written), done


class LedgerOps:
    """The native functions and the addresses of one page ledger's three columns (fixed: the columns never resize)."""

    __slots__ = ("reserve", "move", "release", "count_owned", "sole_owner", "release_unwritable",
                 "release_unwritable_at", "owned_written", "row_owned_written", "state", "owner", "generation",
                 "_columns")

    def __init__(self, lib: Any, state: array, owner: array, generation: array) -> None:
        self.reserve = lib.reserve
        self.move = lib.move
        self.release = lib.release
        self.count_owned = lib.count_owned
        self.sole_owner = lib.sole_owner
        self.release_unwritable = lib.release_unwritable
        self.release_unwritable_at = lib.release_unwritable_at
        self.owned_written = lib.owned_written
        self.row_owned_written = lib.row_owned_written
        self._columns = (state, owner, generation)  # keeps the memory behind the addresses alive
        self.state, self.owner, self.generation = (column.buffer_info()[0] for column in self._columns)
