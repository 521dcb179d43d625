"""Decode's commit chain: the guards' steps run in the chain's order whatever order their hooks were installed in,
the first refusal ends it, each step works with any set of others joined, and installing it through the hook
machinery leaves one wrapper with every owner marked in place (SGLang's commit is a stand-in class here; the real
chain runs in the in-process and e2e tests). The checks that read device memory sit at the commit gate
(tests/unit/test_commit_gate.py)."""

from __future__ import annotations

import inspect
import itertools
import types
from typing import Any

import pytest

from sglang_harden.compat import commit_chain, hook_timer, hooks
from sglang_harden.compat.commit_chain import BEFORE_COMMIT, CommitChain

ALL = BEFORE_COMMIT


def _recording(name: str, calls: list[str], refuse: bool = False) -> commit_chain.Step:
    def step(queue: Any, decode_req: Any, context: dict[str, Any]) -> bool:
        calls.append(name)
        context.setdefault("seen", []).append(name)
        return refuse

    return step


def _commit(calls: list[str]) -> Any:
    def commit(queue: Any, decode_req: Any) -> str:
        calls.append("commit")
        return "committed"

    return commit


@pytest.mark.parametrize("order", list(itertools.permutations(ALL))[::17])
def test_steps_run_in_the_chain_order_whatever_order_they_joined(order: tuple[str, ...]) -> None:
    calls: list[str] = []
    chain = CommitChain()
    for name in order:
        chain.join(name, _recording(name, calls))
    assert chain.around(_commit(calls))(None, None) == "committed"
    assert calls == [*BEFORE_COMMIT, "commit"]


@pytest.mark.parametrize("refusing", BEFORE_COMMIT)
def test_the_first_refusal_ends_the_chain_before_the_commit(refusing: str) -> None:
    calls: list[str] = []
    chain = CommitChain()
    for name in ALL:
        chain.join(name, _recording(name, calls, refuse=name == refusing))
    assert chain.around(_commit(calls))(None, None) is None
    assert calls == list(BEFORE_COMMIT[: BEFORE_COMMIT.index(refusing) + 1])


@pytest.mark.parametrize("subset", [c for n in range(len(ALL) + 1) for c in itertools.combinations(ALL, n)])
def test_each_step_runs_with_any_other_steps_joined(subset: tuple[str, ...]) -> None:
    calls: list[str] = []
    chain = CommitChain()
    for name in subset:
        chain.join(name, _recording(name, calls))
    chain.around(_commit(calls))(None, None)
    assert calls == [n for n in BEFORE_COMMIT if n in subset] + ["commit"]


def test_steps_share_one_context_per_commit() -> None:
    chain = CommitChain()
    contexts: list[dict[str, Any]] = []
    chain.join("ledger", lambda q, d, ctx: bool(ctx.update(transfer=d)))
    chain.join("coverage", lambda q, d, ctx: bool(contexts.append(ctx)))
    commit = chain.around(lambda q, d: None)
    commit(None, "first")
    commit(None, "second")
    assert [c["transfer"] for c in contexts] == ["first", "second"]


def test_an_unknown_step_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown step"):
        CommitChain().join("spellcheck", lambda q, d, ctx: False)


def _queue_module() -> types.ModuleType:
    module = types.ModuleType("fake_decode_for_chain")
    calls: list[str] = []

    class Queue:
        def commit(self, decode_req: Any) -> str:
            calls.append("commit")
            return "committed"

    module.Queue = Queue  # type: ignore[attr-defined]
    module.calls = calls  # type: ignore[attr-defined]
    return module


def test_hooks_joining_one_chain_install_one_wrapper_with_every_owner_in_place(monkeypatch: Any) -> None:
    monkeypatch.delenv(hook_timer.ENV, raising=False)
    module = _queue_module()
    chain = CommitChain()
    owners = [("coverage", "coverage"), ("lifecycle", "ledger")]
    installed = []
    for owner, name in owners:
        hook = hooks.Hook(owner, module.__name__, "Queue.commit", ("self", "decode_req"),
                          commit_chain.join(name, owner, _recording(name, module.calls), chain))
        hooks._install(hook, f"{hook.target}#{owner}", module)
        installed.append(hook)
    monkeypatch.setitem(__import__("sys").modules, module.__name__, module)
    assert all(hooks.is_in_place(h) for h in installed)
    assert module.Queue().commit(None) == "committed"
    assert module.calls == ["ledger", "coverage", "commit"]
    assert inspect.unwrap(module.Queue.commit).__name__ == "commit"  # one layer, no cycle


def test_a_timed_guard_times_its_own_step(monkeypatch: Any) -> None:
    monkeypatch.setenv(hook_timer.ENV, "coverage")
    hook_timer.TIMER.reset()
    module = _queue_module()
    chain = CommitChain()
    for owner, name in (("coverage", "coverage"), ("lifecycle", "ledger")):
        hook = hooks.Hook(owner, module.__name__, "Queue.commit", ("self", "decode_req"),
                          commit_chain.join(name, owner, _recording(name, module.calls), chain))
        hooks._install(hook, f"{hook.target}#{owner}", module)
    module.Queue().commit(None)
    report = hook_timer.TIMER.report()
    key = f"{commit_chain.TARGET}#coverage"
    assert list(report) == [key] and report[key]["count"] == 1
    hook_timer.TIMER.reset()
