"""Which transfer backends the page lifecycle and page-tag guards run on, and what a scheduler on another backend is
told. Each backend's hooks live in its own module (``compat/backends/``)."""

from __future__ import annotations

import pytest

from sglang_harden.compat import backends, sglang_v05
from sglang_harden.compat.backends import mooncake, nixl
from sglang_harden.compat.internals import CONN


def _hook(module: str) -> object:
    return next(h for h in sglang_v05.HOOKS if h.module == module and h.owner == "lifecycle")


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_each_backend_needs_only_its_own_module_hooks(backend: str) -> None:
    own, other = backends.BACKEND_MODULES[backend], {"mooncake": backends.NIXL, "nixl": backends.MOONCAKE}[backend]
    assert backends.needed_on_backend(_hook(own), backend)
    assert not backends.needed_on_backend(_hook(other), backend)
    assert backends.needed_on_backend(_hook(CONN), backend)


@pytest.mark.parametrize("module", [mooncake, nixl], ids=["mooncake", "nixl"])
def test_a_backend_module_hooks_only_its_own_sglang_module(module: object) -> None:
    hooks = module.HOOKS  # type: ignore[attr-defined]
    assert hooks and {h.module for h in hooks} == {backends.BACKEND_MODULES[module.__name__.rpartition(".")[2]]}
    assert {h.qualname.rpartition(".")[2] for h in hooks} >= {"send_metadata", "add_transfer_request",
                                                              "send_kvcache"}


@pytest.mark.parametrize("module", backends.backend_modules(), ids=list(backends.BACKENDS))
def test_every_backend_has_the_one_interface(module: object) -> None:
    """MODULE, RECEIVER and HOOKS are all the hook tables read of a backend: its lifecycle hooks are in the family's
    table, and every guard that reads decode's pages at the receiver (lifecycle, the page-tag ledger, canary) has a
    hook on this backend's receiver without naming the backend anywhere else."""
    name = module.__name__.rpartition(".")[2]  # type: ignore[attr-defined]
    assert module.MODULE == backends.BACKEND_MODULES[name]  # type: ignore[attr-defined]
    receiver = f"{module.RECEIVER}.send_metadata"  # type: ignore[attr-defined]
    table = {(h.owner, h.module, h.qualname) for h in sglang_v05.HOOKS}
    assert {(h.owner, h.module, h.qualname) for h in module.HOOKS} <= table  # type: ignore[attr-defined]
    for owner in ("lifecycle", "page_ledger", "canary"):
        assert (owner, module.MODULE, receiver) in table, (owner, name)  # type: ignore[attr-defined]


def test_other_backends_refused_with_the_way_out() -> None:
    why = backends.check_backend("decode", "mori", ["lifecycle", "page_tags"])
    assert why is not None and "'mori'" in why
    assert "--harden-lifecycle off and --harden-page-tags off" in why
    assert backends.check_backend("prefill", "nixl", ["lifecycle"]) is None
    assert backends.check_backend("null", "mori", ["lifecycle"]) is None  # no PD: nothing to guard


def test_no_backend_guard_armed_runs_anywhere() -> None:
    assert backends.check_backend("decode", "mori", []) is None


def test_guards_needing_a_backend_follow_what_is_armed(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_harden.compat.runtime import RUNTIME

    monkeypatch.setattr(RUNTIME, "armed", ("admission", "page_tags"))
    assert sglang_v05._guards_needing_a_backend("decode") == ["page_tags"]  # page tags alone still need one
    assert sglang_v05._guards_needing_a_backend("prefill") == []
    monkeypatch.setattr(RUNTIME, "armed", ("lifecycle", "page_tags"))
    assert sglang_v05._guards_needing_a_backend("prefill") == ["lifecycle"]
