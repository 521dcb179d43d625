"""Which transfer backends the page lifecycle and page-tag guards run on, and what a scheduler on another backend is
told. Each backend's hooks live in its own module (``compat/backends/``)."""

from __future__ import annotations

import pytest

from sglang_harden.compat import backends, sglang_v05
from sglang_harden.compat.backends import mooncake, nixl
from sglang_harden.compat.internals import CONN


def _hook(module: str) -> object:
    return next(h for h in sglang_v05.HOOKS if h.module == module and h.owner == "lifecycle")


@pytest.mark.parametrize("backend", backends.BACKENDS)
def test_each_backend_needs_only_its_own_module_hooks(backend: str) -> None:
    own = backends.BACKEND_MODULES[backend]
    assert backends.needed_on_backend(_hook(own), backend)
    for other in set(backends.BACKEND_MODULES.values()) - {own}:
        assert not backends.needed_on_backend(_hook(other), backend)
    assert backends.needed_on_backend(_hook(CONN), backend)


@pytest.mark.parametrize("module", [mooncake, nixl], ids=["mooncake", "nixl"])
def test_a_backend_module_hooks_only_its_own_sglang_module(module: object) -> None:
    hooks = module.HOOKS  # type: ignore[attr-defined]
    assert hooks and {h.module for h in hooks} == {backends.BACKEND_MODULES[module.__name__.rpartition(".")[2]]}
    assert {h.qualname.rpartition(".")[2] for h in hooks} >= {"send_metadata", "add_transfer_request",
                                                              "send_kvcache"}


def test_mori_hooks_mark_failed_writes_before_the_ack() -> None:
    """MORI reports a write through statuses; the hooks that turn a Failed one into a failed write sit on the two
    places that wait on them (worker, drainer), on a failed submission and on the abort notice's ack arming."""
    from sglang_harden.compat.backends import mori

    assert {h.qualname for h in mori.HOOKS} == {
        "MoriKVReceiver.send_metadata", "MoriKVManager.add_transfer_request",
        "MoriKVManager._wait_for_chunk_completion", "MoriKVManager._drain_transfer_statuses",
        "MoriKVManager._handle_submission_failure", "MoriKVManager._arm_abort_ack"}
    assert not any(h.optional for h in mori.HOOKS), "a release without MORI's drain ack must refuse, not run unhooked"


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
    why = backends.check_backend("decode", "ascend", ["lifecycle", "page_tags"])
    assert why is not None and "'ascend'" in why
    assert "--harden-lifecycle off and --harden-page-tags off" in why
    assert backends.check_backend("prefill", "nixl", ["lifecycle"]) is None
    assert backends.check_backend("decode", "mori", ["lifecycle", "page_tags"]) is None  # its own module
    assert backends.check_backend("null", "ascend", ["lifecycle"]) is None  # no PD: nothing to guard


def test_no_backend_guard_armed_runs_anywhere() -> None:
    assert backends.check_backend("decode", "ascend", []) is None


def test_guards_needing_a_backend_follow_what_is_armed(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_harden.compat.runtime import RUNTIME

    monkeypatch.setattr(RUNTIME, "armed", ("admission", "page_tags"))
    assert sglang_v05._guards_needing_a_backend("decode") == ["page_tags"]  # page tags alone still need one
    assert sglang_v05._guards_needing_a_backend("prefill") == []
    monkeypatch.setattr(RUNTIME, "armed", ("lifecycle", "page_tags"))
    assert sglang_v05._guards_needing_a_backend("prefill") == ["lifecycle"]
