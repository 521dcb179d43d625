"""Opt-in hook timing (SGLANG_HARDEN_TIME_HOOKS): each hook layer reports only the time it adds, off is untouched."""

from __future__ import annotations

import sys
import time
import types
from collections.abc import Callable

import pytest

from sglang_harden.compat import hook_timer, hooks

ORIGINAL_S = 0.05
OUTER_S = 0.02
INNER_S = 0.01
SLACK_S = 0.025  # scheduling noise allowed; a wrong attribution adds >= 40 ms

Func = Callable[..., object]


def _fake_queue_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)

    class Queue:
        def commit(self, req: object) -> str:
            time.sleep(ORIGINAL_S)
            return f"committed {req}"

        def release(self, req: object) -> str:
            return f"released {req}"

    module.Queue = Queue  # type: ignore[attr-defined]
    sys.modules[name] = module
    return module


def _sleeping(seconds: float) -> Callable[[Func], Func]:
    def make(original: Func) -> Func:
        def commit(self: object, req: object) -> object:
            time.sleep(seconds / 2)
            result = original(self, req)
            time.sleep(seconds / 2)
            return result

        return commit

    return make


def _hook(module: str, owner: str, make: Callable[[Func], Func], qualname: str = "Queue.commit") -> hooks.Hook:
    return hooks.Hook(owner, module, qualname, ("self", "req"), make)


def _added(module: str, owner: str, qualname: str = "Queue.commit") -> dict[str, float]:
    return hook_timer.TIMER.report()[f"{module}.{qualname}#{owner}"]


def test_a_timed_hook_reports_its_own_time_not_the_originals(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(hook_timer.ENV, "lifecycle")
    module = _fake_queue_module("fake_sglang_timed_one")
    hooks.register(_hook(module.__name__, "lifecycle", _sleeping(OUTER_S)))

    assert module.Queue().commit("a") == "committed a"

    stats = _added(module.__name__, "lifecycle")
    assert stats["count"] == 1
    assert OUTER_S <= stats["total_us"] / 1e6 < OUTER_S + SLACK_S


def test_nested_hooks_on_one_target_each_report_their_own_share(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(hook_timer.ENV, "lifecycle, page_tags")
    module = _fake_queue_module("fake_sglang_timed_nested")
    hooks.register(_hook(module.__name__, "lifecycle", _sleeping(INNER_S)))
    hooks.register(_hook(module.__name__, "page_tags", _sleeping(OUTER_S)))

    assert module.Queue().commit("b") == "committed b"

    inner_share = _added(module.__name__, "lifecycle")["total_us"] / 1e6
    outer_share = _added(module.__name__, "page_tags")["total_us"] / 1e6
    assert INNER_S <= inner_share < INNER_S + SLACK_S
    assert OUTER_S <= outer_share < OUTER_S + SLACK_S
    assert hooks.missing([_hook(module.__name__, o, _sleeping(0)) for o in ("lifecycle", "page_tags")]) == []


def test_a_timed_target_the_wrapper_calls_reports_itself_and_not_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(hook_timer.ENV, "lifecycle")
    module = _fake_queue_module("fake_sglang_timed_calls_other")

    def release_slowly(original: Func) -> Func:
        def release(self: object, req: object) -> object:
            time.sleep(ORIGINAL_S)
            return original(self, req)

        return release

    def commit_then_release(original: Func) -> Func:
        def commit(self: object, req: object) -> object:
            time.sleep(OUTER_S)
            return self.release(original(self, req))  # type: ignore[attr-defined]

        return commit

    hooks.register(_hook(module.__name__, "lifecycle", release_slowly, "Queue.release"))
    hooks.register(_hook(module.__name__, "lifecycle", commit_then_release))

    assert module.Queue().commit("c") == "released committed c"

    released = _added(module.__name__, "lifecycle", "Queue.release")["total_us"] / 1e6
    assert ORIGINAL_S <= released < ORIGINAL_S + SLACK_S
    assert OUTER_S <= _added(module.__name__, "lifecycle")["total_us"] / 1e6 < OUTER_S + SLACK_S


def test_an_untimed_owner_gets_the_plain_wrapper(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(hook_timer.ENV, "page_tags")
    module = _fake_queue_module("fake_sglang_untimed")
    plain = module.Queue.__dict__["commit"]
    seen: list[Func] = []

    def remember(original: Func) -> Func:
        def commit(self: object, req: object) -> object:
            return original(self, req)

        seen.extend((original, commit))
        return commit

    hooks.register(_hook(module.__name__, "lifecycle", remember))

    assert seen[0] is plain
    assert module.Queue.__dict__["commit"] is seen[1]
    assert module.Queue().commit("d") == "committed d"
    assert f"{module.__name__}.Queue.commit#lifecycle" not in hook_timer.TIMER.report()


def test_with_the_variable_unset_nothing_is_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(hook_timer.ENV, raising=False)
    module = _fake_queue_module("fake_sglang_unset")
    plain = module.Queue.__dict__["commit"]
    seen: list[Func] = []

    def remember(original: Func) -> Func:
        seen.append(original)
        return _sleeping(0)(original)

    hooks.register(_hook(module.__name__, "lifecycle", remember))

    assert seen == [plain]
    assert module.Queue.__dict__["commit"].__code__ is _sleeping(0)(plain).__code__
    assert f"{module.__name__}.Queue.commit#lifecycle" not in hook_timer.TIMER.report()


def test_timer_reports_count_total_mean_and_worst() -> None:
    timer = hook_timer.HookTimer()
    timer.add("t#o", 0.001)
    timer.add("t#o", 0.003)
    assert timer.report() == {"t#o": {"count": 2, "total_us": 4000.0, "mean_us": 2000.0, "max_us": 3000.0}}
    timer.reset()
    assert timer.report() == {}
