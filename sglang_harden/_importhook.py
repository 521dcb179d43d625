"""Post-import hooks: run a callback right after a named module finishes executing.

SGLang starts its scheduler and detokenizer with the ``spawn`` method, so every child re-imports SGLang from
scratch. Registering a callback per target module makes patches land in whichever process imports the module,
at the moment it is imported, and immediately for modules that are already loaded.

How: a ``sys.meta_path`` finder that, for a name with pending callbacks, asks the other finders for the spec
(in ``sys.meta_path`` order, the spec the import system would have used) and wraps its loader so that the
callbacks run once the module's body has executed. The wrapper then hands the real loader back to the module
(``__loader__``, ``__spec__.loader``) and forwards every other attribute to it.

Beside other import hooks (issue 19). Tracing agents, wrapt-style finders and test shims do the same thing for
their own names: ask the other finders, wrap the loader. Two such finders that each ask "everyone but me"
recurse forever unless at least one remembers what it is resolving. Ours does, per thread: while this thread
is asking the other finders for ``name``, our finder answers ``None`` for ``name`` (the other finder then goes
on to the real one). So a delegating finder placed before or after ours, guarded or not, terminates, and both
loader wrappers run (theirs and ours, in the order of nesting); our callbacks run exactly once because they
are taken off the registry when they run. The guard is per thread (``threading.local``) so that another thread
resolving the same name, e.g. through ``importlib.util.find_spec``, still gets the hooked loader. Loaders with
only ``load_module`` (old wrapt-style chained loaders) get a ``load_module`` wrapper; the import system then
takes its legacy path as it would have without us.

Fail closed. A callback's exception propagates out of the import (a guard whose hook cannot install must
not run unhooked); the module is not left in ``sys.modules`` and every callback of that module goes back on
the registry, so an importer that catches the error and tries again fails the same way instead of getting an
unhooked module.

Why hand-written, not a library:
- ``importlib`` has no post-import hook; this module is built only on its documented protocol
  (``MetaPathFinder.find_spec``, ``Loader.create_module``/``exec_module``, ``ModuleSpec``).
  ``importlib.util.find_spec`` would not replace the loop over the other finders: it re-enters
  ``sys.meta_path`` (including this finder, so it needs the same guard), answers from ``sys.modules`` and
  imports parent packages as a side effect.
- ``wrapt.register_post_import_hook`` would add a run-time dependency (sglang-harden has none) to every
  operator's SGLang environment, including old pinned ones, importable from the ``.pth`` start-up hook before
  anything else runs, and it would share that install with whatever version the operator's tracing agent pins.
  Its hook exceptions do propagate, but it calls a hook at once for any name already in ``sys.modules``, also a
  module still executing its body (we defer those, see ``_is_initialising``), and it drops a module's hooks
  before running them, so after a hook raised a retried import comes up unhooked: fail open for us.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

Callback = Callable[[ModuleType], None]

_lock = threading.RLock()
_pending: dict[str, list[Callback]] = {}
_resolving = threading.local()  # .names: the names this thread is asking the other finders about right now


def when_imported(module_name: str, callback: Callback, first: bool = False) -> None:
    """Call ``callback(module)`` once ``module_name`` is imported (now, if it already is). ``first``: before
    the callbacks registered earlier (a test shim standing in for a different SGLang build must change the
    module before any hook looks at it)."""
    with _lock:
        module = sys.modules.get(module_name)
        if module is None or _is_initialising(module):
            queue = _pending.setdefault(module_name, [])
            queue.insert(0 if first else len(queue), callback)
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
    """Run ``module``'s callbacks once, also those registered meanwhile (the module still counts as
    initialising, so ``when_imported`` queues them); if one raises, put them all back (a re-import runs them)."""
    name = module.__name__
    taken: list[Callback] = []
    try:
        while True:
            with _lock:
                callbacks = _pending.pop(name, [])
            if not callbacks:
                return
            taken += callbacks
            for callback in callbacks:
                callback(module)
    except BaseException:
        with _lock:
            _pending[name] = taken + _pending.get(name, [])
        raise


def _hand_back_loader(module: ModuleType, wrapper: object, inner: object) -> None:
    """The module keeps its real loader (``inspect``, ``importlib.resources`` and reloads look there)."""
    if getattr(module, "__loader__", None) is wrapper:
        try:
            module.__loader__ = inner
        except AttributeError:
            pass
    spec = getattr(module, "__spec__", None)
    if spec is not None and spec.loader is wrapper:
        spec.loader = inner


class _HookedLoader(importlib.abc.Loader):
    """The real loader, then the callbacks."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        create = getattr(self._inner, "create_module", None)
        return None if create is None else create(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _hand_back_loader(module, self, self._inner)
        _run_callbacks(module)  # raising here makes the import system drop the module from sys.modules

    def __getattr__(self, name: str) -> object:
        if name == "_inner":  # not set yet (copy, pickle): no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self._inner, name)


class _HookedLegacyLoader:
    """For a loader with only ``load_module``: the import system calls ``load_module`` on us instead."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def load_module(self, fullname: str) -> ModuleType:
        module = self._inner.load_module(fullname)
        _hand_back_loader(module, self, self._inner)
        try:
            _run_callbacks(module)
        except BaseException:
            if sys.modules.get(fullname) is module:  # the legacy path leaves a failed module in sys.modules
                del sys.modules[fullname]
            raise
        return module

    def __getattr__(self, name: str) -> object:
        if name == "_inner":  # not set yet (copy, pickle): no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self._inner, name)


def _hooked(loader: Any) -> Any:
    if isinstance(loader, _HookedLoader | _HookedLegacyLoader):
        return loader
    if hasattr(loader, "exec_module"):
        return _HookedLoader(loader)
    if hasattr(loader, "load_module"):
        return _HookedLegacyLoader(loader)
    return loader  # not a loader the import system can use either; let it fail as it would without us


def _resolving_names() -> set[str]:
    names = getattr(_resolving, "names", None)
    if names is None:
        names = _resolving.names = set()
    return names


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object, target: object = None) -> object:
        with _lock:
            if fullname not in _pending:
                return None
        resolving = _resolving_names()
        if fullname in resolving:
            return None  # re-entered through another finder that delegates: let it go on to the real one
        resolving.add(fullname)
        try:
            spec = self._find_elsewhere(fullname, path, target)
        finally:
            resolving.discard(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _hooked(spec.loader)
        return spec

    def _find_elsewhere(self, fullname: str, path: object, target: object) -> Any:
        for finder in list(sys.meta_path):
            find_spec = None if finder is self else getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None


_finder = _PostImportFinder()


def _ensure_finder_installed() -> None:
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
