"""Post-import hooks: run a callback right after a named module finishes executing.

SGLang starts its scheduler and detokenizer with the ``spawn`` method, so every child re-imports SGLang from
scratch. Registering a callback per target module makes patches land in whichever process imports the module,
at the moment it is imported, and immediately for modules that are already loaded.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from types import ModuleType

Callback = Callable[[ModuleType], None]

_lock = threading.RLock()
_pending: dict[str, list[Callback]] = {}


def when_imported(module_name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once ``module_name`` is imported (now, if it already is)."""
    with _lock:
        module = sys.modules.get(module_name)
        if module is None or _is_initialising(module):
            _pending.setdefault(module_name, []).append(callback)
            _ensure_finder_installed()
            return
    callback(module)


def pending_modules() -> list[str]:
    with _lock:
        return sorted(_pending)


def _is_initialising(module: ModuleType) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(spec is not None and getattr(spec, "_initializing", False))


def _run_callbacks(module: ModuleType) -> None:
    with _lock:
        callbacks = _pending.pop(module.__name__, [])
    for callback in callbacks:
        callback(module)


class _LoaderWrapper(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _run_callbacks(module)

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object, target: object = None) -> object:
        with _lock:
            if fullname not in _pending:
                return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and not isinstance(spec.loader, _LoaderWrapper):
                    spec.loader = _LoaderWrapper(spec.loader)
                return spec
        return None


_finder = _PostImportFinder()


def _ensure_finder_installed() -> None:
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
