"""Post-import hooks beside other import hooks that also delegate to the finders on ``sys.meta_path``.

Tracing agents and test shims install ``sys.meta_path`` finders that, for a few names, ask the other finders
for the spec and wrap its loader. Ours does the same; before issue 19 two such finders asked each other
forever (``RecursionError`` at server start). Here, real modules (files under ``tmp_path``) are imported beside:

- a naive delegating finder (asks every finder except itself, remembers nothing) before and after ours;
- a wrapt-style finder (per-thread in-progress set, asks the import system again, wraps the loader), with a
  modern (``exec_module``) and a legacy (``load_module`` only) loader wrapper.

Every case: the module imports normally, each callback runs exactly once, and a callback's exception reaches
the importer (a guard that cannot hook must fail closed), also on a second try.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import itertools
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from sglang_harden import _importhook
from sglang_harden._importhook import pending_modules, when_imported

_names = itertools.count()


# ------------------------------------------------------------------------------------------ other finders


class _RecordingLoader(importlib.abc.Loader):
    """Another tool's loader wrapper: runs the real loader, then notes the module (its own "hook")."""

    def __init__(self, inner: Any, seen: list[str]) -> None:
        self.inner, self.seen = inner, seen

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        self.seen.append(module.__name__)


class _LegacyRecordingLoader:
    """As old wrapt's chained loader: only ``load_module`` (the import system then calls that)."""

    def __init__(self, inner: Any, seen: list[str]) -> None:
        self.inner, self.seen = inner, seen

    def load_module(self, fullname: str) -> ModuleType:
        if hasattr(self.inner, "exec_module"):
            spec = importlib.util.spec_from_loader(fullname, self.inner, origin=getattr(self.inner, "path", None))
            assert spec is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[fullname] = module
            try:
                self.inner.exec_module(module)
            except BaseException:
                sys.modules.pop(fullname, None)
                raise
        else:
            self.inner.load_module(fullname)
        module = sys.modules[fullname]
        self.seen.append(fullname)
        return module


class NaiveDelegatingFinder(importlib.abc.MetaPathFinder):
    """Asks every other finder on ``sys.meta_path`` for a watched name and wraps the loader; no guard at all."""

    def __init__(self, names: set[str]) -> None:
        self.names, self.seen, self.calls = names, [], 0

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.names:
            return None
        self.calls += 1
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RecordingLoader(spec.loader, self.seen)
                return spec
        return None


class WraptStyleFinder(importlib.abc.MetaPathFinder):
    """Per-thread "already resolving" set; asks the whole import system again (``importlib.util.find_spec``)."""

    def __init__(self, names: set[str], legacy_loader: bool = False) -> None:
        self.names, self.legacy_loader, self.seen = names, legacy_loader, []
        self._local = threading.local()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        resolving = self._local.__dict__.setdefault("names", set())
        if fullname not in self.names or fullname in resolving:
            return None
        resolving.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            resolving.discard(fullname)
        if spec is None or spec.loader is None:
            return spec
        wrapper = _LegacyRecordingLoader if self.legacy_loader else _RecordingLoader
        spec.loader = wrapper(spec.loader, self.seen)  # type: ignore[assignment]
        return spec


# ------------------------------------------------------------------------------------------------ helpers


@pytest.fixture
def modules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``modules.new(body)`` writes a fresh top-level module (``pkg=True``: a package with a ``sub``)."""

    class Maker:
        def new(self, body: str = "VALUE = 42\n", pkg: bool = False) -> str:
            name = f"_sglang_harden_ih_{next(_names)}"
            if pkg:
                (tmp_path / name).mkdir()
                (tmp_path / name / "__init__.py").write_text("")
                (tmp_path / name / "sub.py").write_text(body)
            else:
                (tmp_path / f"{name}.py").write_text(body)
            made.append(name)
            importlib.invalidate_caches()
            return name

    made: list[str] = []
    monkeypatch.syspath_prepend(str(tmp_path))
    saved_meta_path = list(sys.meta_path)
    saved_pending = {k: list(v) for k, v in _importhook._pending.items()}
    try:
        yield Maker()
    finally:
        sys.meta_path[:] = saved_meta_path
        _importhook._pending.clear()
        _importhook._pending.update(saved_pending)
        for name in list(sys.modules):
            if any(name == m or name.startswith(m + ".") for m in made):
                del sys.modules[name]


def _place(finder: importlib.abc.MetaPathFinder, where: str) -> None:
    """Put ``finder`` right before or right after ours (ours is installed by the first ``when_imported``)."""
    ours = sys.meta_path.index(_importhook._finder)
    sys.meta_path.insert(ours if where == "before" else ours + 1, finder)


def _hook(name: str) -> list[ModuleType]:
    calls: list[ModuleType] = []
    when_imported(name, calls.append)
    return calls


# ------------------------------------------------------------------------------------------------- tests


def test_plain_import_runs_callback_once_and_leaves_the_real_loader(modules: Any) -> None:
    name = modules.new()
    calls = _hook(name)
    assert name in pending_modules()
    module = importlib.import_module(name)
    assert calls == [module] and module.VALUE == 42
    assert name not in pending_modules()
    assert isinstance(module.__loader__, importlib.machinery.SourceFileLoader)
    assert isinstance(module.__spec__.loader, importlib.machinery.SourceFileLoader)


def test_already_imported_module_calls_back_at_once(modules: Any) -> None:
    name = modules.new()
    module = importlib.import_module(name)
    calls = _hook(name)
    assert calls == [module] and name not in pending_modules()


@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.parametrize("pkg", [False, True], ids=["module", "submodule"])
def test_naive_delegating_finder(modules: Any, where: str, pkg: bool) -> None:
    name = modules.new(pkg=pkg)
    target = f"{name}.sub" if pkg else name
    calls = _hook(target)
    naive = NaiveDelegatingFinder({target})
    _place(naive, where)
    module = importlib.import_module(target)
    assert module.VALUE == 42
    assert calls == [module]
    assert naive.seen and set(naive.seen) == {target}  # its own loader wrapper ran too
    assert sys.modules[target] is module


@pytest.mark.parametrize("where", ["before", "after"])
@pytest.mark.parametrize("legacy", [False, True], ids=["exec_module", "load_module"])
def test_wrapt_style_finder(modules: Any, where: str, legacy: bool) -> None:
    name = modules.new()
    calls = _hook(name)
    other = WraptStyleFinder({name}, legacy_loader=legacy)
    _place(other, where)
    module = importlib.import_module(name)
    assert module.VALUE == 42
    assert calls == [module]
    assert other.seen == [name]


def test_naive_and_wrapt_style_finders_together(modules: Any) -> None:
    name = modules.new()
    calls = _hook(name)
    naive, modern, legacy = NaiveDelegatingFinder({name}), WraptStyleFinder({name}), WraptStyleFinder({name}, True)
    _place(naive, "before")
    _place(modern, "after")
    sys.meta_path.insert(0, legacy)  # outermost: its load_module-only wrapper ends up around everyone's
    module = importlib.import_module(name)
    assert calls == [module] and module.VALUE == 42
    assert naive.seen and modern.seen and legacy.seen


@pytest.mark.parametrize("where", ["before", "after", "none"])
def test_callback_exception_reaches_the_importer_every_time(modules: Any, where: str) -> None:
    """A hook that cannot install must stop the import, also when the importer tries again."""
    name = modules.new()
    ran: list[str] = []

    def broken(module: ModuleType) -> None:
        ran.append("broken")
        raise RuntimeError("hook target moved")

    when_imported(name, broken)
    when_imported(name, lambda module: ran.append("second"))
    if where != "none":
        _place(NaiveDelegatingFinder({name}), where)
    for attempt in (1, 2):
        with pytest.raises(RuntimeError, match="hook target moved"):
            importlib.import_module(name)
        assert name not in sys.modules
        assert ran == ["broken"] * attempt  # the callbacks after the broken one never see a half-hooked module
        assert name in pending_modules()


def test_callback_that_imports_another_hooked_module(modules: Any) -> None:
    inner, outer = modules.new(), modules.new()
    order: list[str] = []
    when_imported(inner, lambda module: order.append(inner))

    def import_inner(module: ModuleType) -> None:
        importlib.import_module(inner)
        order.append(outer)

    when_imported(outer, import_inner)
    _place(NaiveDelegatingFinder({inner, outer}), "before")
    importlib.import_module(outer)
    assert order == [inner, outer]


def test_in_progress_guard_is_per_thread(modules: Any) -> None:
    """While one thread is resolving a name, another thread resolving the same name still gets our loader."""
    name = modules.new()
    _hook(name)
    entered, release = threading.Event(), threading.Event()

    class Blocking(importlib.abc.MetaPathFinder):
        def __init__(self) -> None:
            self.first = True

        def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
            if fullname == name and self.first and threading.current_thread() is not threading.main_thread():
                self.first = False
                entered.set()
                release.wait(10)
            return None

    _place(Blocking(), "after")
    results: dict[str, Any] = {}

    def resolve(key: str) -> None:
        results[key] = _importhook._finder.find_spec(name, None)

    first = threading.Thread(target=resolve, args=("first",))
    first.start()
    try:
        assert entered.wait(10)
        second = threading.Thread(target=resolve, args=("second",))
        second.start()
        second.join(10)
    finally:
        release.set()
        first.join(10)
    for key in ("first", "second"):
        spec = results[key]
        assert spec is not None and spec.name == name, results
        assert type(spec.loader).__module__ == _importhook.__name__, (key, spec.loader)


@pytest.mark.parametrize("where", ["before", "after"])
def test_testbed_delegating_finder_shim_in_a_fresh_interpreter(tmp_path: Path, where: str) -> None:
    """The e2e's shim (loaded by the testbed's sitecustomize): a hooked ``sglang`` submodule imports, the
    callback runs once, and the shim's wrapper reports the module it loaded."""
    import os
    import subprocess

    from sglang_harden.testbed.procenv import SHIMS_DIR

    fake = tmp_path / "sglang" / "srt"
    fake.mkdir(parents=True)
    (tmp_path / "sglang" / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "target.py").write_text("VALUE = 7\n")
    code = (
        "from sglang_harden._importhook import when_imported\n"
        "calls = []\n"
        "when_imported('sglang.srt.target', calls.append)\n"
        "import sglang.srt.target as t\n"
        "print('calls', len(calls), t.VALUE)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(SHIMS_DIR), str(Path(__file__).resolve().parents[2]), str(tmp_path)]),
        "SGLANG_HARDEN_TESTBED_SHIMS": "",
        "SGLANG_HARDEN_TESTBED_DELEGATING_FINDER": where,
    }
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "calls 1 7" in out.stdout
    assert "delegating-finder: loaded sglang.srt.target pid=" in out.stderr and f"position={where}" in out.stderr


def test_callback_registered_by_a_callback_for_the_same_module_runs(modules: Any) -> None:
    """While the callbacks run, the module still counts as initialising, so ``when_imported`` queues."""
    name = modules.new()
    order: list[str] = []

    def first(module: ModuleType) -> None:
        order.append("first")
        when_imported(name, lambda m: order.append("late"))

    when_imported(name, first)
    _place(NaiveDelegatingFinder({name}), "after")
    importlib.import_module(name)
    assert order == ["first", "late"] and name not in pending_modules()


def test_hooked_loader_forwards_and_survives_copy() -> None:
    import copy

    inner = importlib.machinery.SourceFileLoader("x", __file__)
    wrapped = _importhook._hooked(inner)
    assert wrapped.get_filename("x") == __file__
    assert copy.copy(wrapped)._inner is inner
    assert _importhook._hooked(wrapped) is wrapped


def test_first_callback_runs_before_earlier_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_harden._importhook import when_imported

    (tmp_path / "shim_order_target.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[str] = []
    when_imported("shim_order_target", lambda m: seen.append("hook"))
    when_imported("shim_order_target", lambda m: seen.append("shim"), first=True)
    import shim_order_target  # noqa: F401

    assert seen == ["shim", "hook"]
