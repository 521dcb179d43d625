"""Test hook (test-only): another tool's import hook beside ours. Enabled by SGLANG_HARDEN_TESTBED_DELEGATING_FINDER.

``SGLANG_HARDEN_TESTBED_DELEGATING_FINDER=before|after`` installs, in every process the testbed starts (spawned
schedulers too: they load ``sitecustomize`` again), a ``sys.meta_path`` finder of the naive kind tracing agents
and test shims use: for every ``sglang`` module it asks every other finder, sglang-harden's included, for the
spec and wraps the loader, and it remembers nothing of what it is resolving. Before issue 19 sglang-harden's
finder did the same and the two asked each other forever (``RecursionError`` at server start).

``before`` puts it right ahead of sglang-harden's finder in ``sys.meta_path``, ``after`` right behind it.
When its wrapper has loaded a module that had sglang-harden callbacks pending at lookup, it prints
``sglang-harden-testbed delegating-finder: loaded <module> pid=<pid> position=<pos> inner=<loader type>``.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any

from sglang_harden import _importhook

ENV = "SGLANG_HARDEN_TESTBED_DELEGATING_FINDER"
LINE = "sglang-harden-testbed delegating-finder: loaded"


class _WrappingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any, report: bool, position: str) -> None:
        self.inner, self.report, self.position = inner, report, position

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        if self.report:
            where = f"pid={os.getpid()} position={self.position} inner={type(self.inner).__name__}"
            print(f"{LINE} {module.__name__} {where}", file=sys.stderr, flush=True)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


class NaiveDelegatingFinder(importlib.abc.MetaPathFinder):
    """Asks every finder but itself for ``sglang`` modules and wraps the loader; no re-entrancy guard."""

    def __init__(self, position: str) -> None:
        self.position = position

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "sglang" and not fullname.startswith("sglang."):
            return None
        report = fullname in _importhook.pending_modules()
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _WrappingLoader(spec.loader, report, self.position)
                return spec
        return None


def install() -> None:
    position = os.environ[ENV]
    if position not in ("before", "after"):
        raise RuntimeError(f"{ENV}={position!r}: expected 'before' or 'after'")
    if any(isinstance(f, NaiveDelegatingFinder) for f in sys.meta_path):
        return
    _importhook._ensure_finder_installed()
    ours = sys.meta_path.index(_importhook._finder)
    sys.meta_path.insert(ours if position == "before" else ours + 1, NaiveDelegatingFinder(position))
