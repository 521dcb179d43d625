"""compat without SGLang: pin gate, hook installer, launcher arguments, config parsing."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from sglang_harden.compat import SUPPORTED_PINS, family_module_for, hooks
from sglang_harden.compat.runtime import HardenRefusal
from sglang_harden.config import CapacityMode, ConfigError, Mode, flag_to_env, load_config
from sglang_harden.launch_server import split_harden_args


def test_unknown_pin_refused_with_pin_and_override_named() -> None:
    with pytest.raises(HardenRefusal) as info:
        family_module_for("0.5.99", allow_unknown=False)
    message = str(info.value)
    assert "0.5.99" in message and "SGLANG_HARDEN_ALLOW_UNKNOWN_PIN" in message
    assert "--harden-allow-unknown-pin" in message


def test_unknown_pin_allowed_by_override_takes_the_family_its_code_fits(monkeypatch: pytest.MonkeyPatch,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Not the nearest version string: the family whose hooks resolve on the release's code (0.4.10.x is a 0.4.9
    release by its code, tests/integration/test_doctor_wheels.py reads the real trees)."""
    from sglang_harden import compat

    monkeypatch.setattr(compat, "probe_family", lambda: ("sglang_v049", "sglang_v049", []))
    assert family_module_for("0.4.10.post2", allow_unknown=True) == "sglang_v049"
    monkeypatch.setattr(compat, "probe_family", lambda: (None, "sglang_v05", ["x.Y.z: not found"]))
    with caplog.at_level("WARNING", logger="sglang_harden"):
        assert family_module_for("0.5.99", allow_unknown=True) == "sglang_v05"
    assert "no adapter family fits" in caplog.text and "x.Y.z: not found" in caplog.text


def test_missing_sglang_refused() -> None:
    with pytest.raises(HardenRefusal, match="not installed"):
        family_module_for(None, allow_unknown=True)


def test_every_ci_pin_has_a_family() -> None:
    from sglang_harden.testbed.envs import ci_pins

    assert set(ci_pins()) <= set(SUPPORTED_PINS)


def _fake_module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)

    class Queue:
        def add(self, req: object, num_kv_heads: int) -> str:
            return f"added {req}"

    module.Queue = Queue  # type: ignore[attr-defined]
    sys.modules[name] = module
    return module


def _guarded(original: hooks.Callable[..., object]) -> hooks.Callable[..., object]:
    def add(self: object, req: object, num_kv_heads: int) -> object:
        return "rejected" if req == "bad" else original(self, req, num_kv_heads)

    return add


def test_hook_installs_on_loaded_module_and_is_verifiable() -> None:
    module = _fake_module("fake_sglang_ok")
    hook = hooks.Hook("admission", "fake_sglang_ok", "Queue.add", ("self", "req", "num_kv_heads"), _guarded)
    assert hooks.missing([hook]) == ["admission -> fake_sglang_ok.Queue.add"]
    hooks.register(hook)
    queue = module.Queue()
    assert queue.add("bad", 2) == "rejected"
    assert queue.add("good", 2) == "added good"
    assert hooks.missing([hook]) == []


def test_optional_hook_on_a_module_not_loaded_is_not_missing() -> None:
    """An optional hook whose module this process never imported (0.5.19 has no pp_consensus_store; a process that
    does not load it calls nothing there) is not a gap; a required one is, and so is an optional one once its module
    is loaded without the hook in place."""
    optional = hooks.Hook("zmq_auth", "fake_sglang_absent_mod", "Store._init_zmq", ("self",), _guarded,
                          optional=True)
    required = hooks.Hook("zmq_auth", "fake_sglang_absent_mod", "Store._init_zmq", ("self",), _guarded)
    assert hooks.missing([optional]) == []
    assert hooks.missing([required]) == ["zmq_auth -> fake_sglang_absent_mod.Store._init_zmq"]
    _fake_module("fake_sglang_loaded_mod")
    loaded = hooks.Hook("admission", "fake_sglang_loaded_mod", "Queue.add", ("self", "req", "num_kv_heads"), _guarded,
                        optional=True)
    assert hooks.missing([loaded]) == ["admission -> fake_sglang_loaded_mod.Queue.add"]


def test_hook_signature_mismatch_fails_closed() -> None:
    _fake_module("fake_sglang_moved")
    hook = hooks.Hook("admission", "fake_sglang_moved", "Queue.add", ("self", "req", "is_retracted"), _guarded)
    with pytest.raises(hooks.HookInstallError, match="expected parameters"):
        hooks.register(hook)


def test_hook_missing_target_fails_closed() -> None:
    _fake_module("fake_sglang_gone")
    hook = hooks.Hook("admission", "fake_sglang_gone", "Queue.pop_bootstrapped", ("self",), _guarded)
    with pytest.raises(hooks.HookInstallError, match="not found"):
        hooks.register(hook)


def test_hook_waits_for_module_import(tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    package = tmp_path / "late_sglang_mod.py"  # type: ignore[operator]
    package.write_text("class Queue:\n    def add(self, req, num_kv_heads):\n        return 'added'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    hook = hooks.Hook("admission", "late_sglang_mod", "Queue.add", ("self", "req", "num_kv_heads"), _guarded)
    hooks.register(hook)
    import late_sglang_mod  # type: ignore[import-not-found]

    assert late_sglang_mod.Queue().add("bad", 1) == "rejected"


def test_launcher_splits_harden_options() -> None:
    env, rest = split_harden_args(
        ["--model-path", "m", "--harden-capacity", "clamp", "--port", "1", "--harden-coverage=log"]
    )
    assert rest == ["--model-path", "m", "--port", "1"]
    assert env == {"SGLANG_HARDEN_CAPACITY": "clamp", "SGLANG_HARDEN_COVERAGE": "log"}


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--harden-nonsense", "1"], "unknown option"),
        (["--harden-capacity", "maybe"], "SGLANG_HARDEN_CAPACITY"),
        (["--harden-admission"], "needs a value"),
    ],
)
def test_launcher_rejects_bad_options(argv: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        split_harden_args(argv)


def test_config_defaults_are_safe_and_env_overrides() -> None:
    default = load_config({})
    assert all(default.mode(g) is Mode.ENFORCE for g in default.active_guards())
    assert default.capacity is CapacityMode.ENFORCE
    tuned = load_config({"SGLANG_HARDEN_RETIRE": "off", "SGLANG_HARDEN_CAPACITY": "log"})
    assert "retire" not in tuned.active_guards()
    assert tuned.capacity is CapacityMode.LOG


def test_config_bad_value_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="SGLANG_HARDEN_QUARANTINE_CAP_PAGES"):
        load_config({"SGLANG_HARDEN_QUARANTINE_CAP_PAGES": "-3"})
    with pytest.raises(ConfigError):
        flag_to_env("--harden-admission", "sometimes")


def _with_config(monkeypatch: pytest.MonkeyPatch, **changes: object) -> None:
    import dataclasses

    from sglang_harden.compat.runtime import RUNTIME

    monkeypatch.setattr(RUNTIME, "config", dataclasses.replace(RUNTIME.config, **changes))


def _auth_hook() -> object:
    from sglang_harden.compat.hooks import Hook

    return Hook("bootstrap_auth", "sglang_harden_test_never_imported", "Server._setup_routes", ("self",),
                lambda original: original)


def test_bootstrap_auth_is_not_armed_without_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang_harden import compat
    from sglang_harden.compat import control_auth
    from sglang_harden.compat.runtime import RUNTIME

    _with_config(monkeypatch, bootstrap_secret_file="")
    monkeypatch.delenv("SGLANG_HARDEN_BOOTSTRAP_AUTH", raising=False)
    monkeypatch.setattr(RUNTIME, "armed", ())
    compat._check_control_auth([_auth_hook()])
    compat._register_enabled([_auth_hook()])
    assert "bootstrap_auth" not in RUNTIME.armed
    assert control_auth.status() == "unauthenticated"


def test_bootstrap_auth_armed_with_a_secret_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from sglang_harden import compat
    from sglang_harden.compat import control_auth
    from sglang_harden.compat.runtime import RUNTIME

    secret = tmp_path / "secret"
    secret.write_text("k" * 40 + "\n")
    secret.chmod(0o600)
    _with_config(monkeypatch, bootstrap_secret_file=str(secret))
    monkeypatch.setattr(RUNTIME, "armed", ())
    compat._check_control_auth([_auth_hook()])
    compat._register_enabled([_auth_hook()])
    assert "bootstrap_auth" in RUNTIME.armed
    assert control_auth.status() == "enforce"


def test_control_auth_refusals(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from sglang_harden import compat
    from sglang_harden.compat.runtime import HardenRefusal

    _with_config(monkeypatch, bootstrap_secret_file="")
    monkeypatch.setenv("SGLANG_HARDEN_BOOTSTRAP_AUTH", "enforce")
    with pytest.raises(HardenRefusal, match="needs a secret"):
        compat._check_control_auth([_auth_hook()])
    monkeypatch.delenv("SGLANG_HARDEN_BOOTSTRAP_AUTH")
    weak = tmp_path / "weak"
    weak.write_text("hunter2\n")
    _with_config(monkeypatch, bootstrap_secret_file=str(weak))
    with pytest.raises(HardenRefusal) as refused:
        compat._check_control_auth([_auth_hook()])
    assert "hunter2" not in str(refused.value) and "at least 32" in str(refused.value)
    _with_config(monkeypatch, bootstrap_secret_file=str(tmp_path / "missing"))
    with pytest.raises(HardenRefusal, match="cannot read"):
        compat._check_control_auth([_auth_hook()])
    good = tmp_path / "good"
    good.write_text("g" * 40 + "\n")
    _with_config(monkeypatch, bootstrap_secret_file=str(good))
    with pytest.raises(HardenRefusal, match="not available on SGLang"):
        compat._check_control_auth([])  # a family with nothing to hook it into (0.4.9)


class _Router:
    """aiohttp's router as far as the hooks use it (``add_route``, ``routes()`` with each route's resource info);
    like aiohttp, a second route for the same method and path is refused."""

    def __init__(self, served: tuple[tuple[str, str], ...] = ()) -> None:
        self.added: list[tuple[str, str]] = []
        self._all = list(served)

    def add_route(self, method: str, path: str, _handler: object) -> None:
        if (method, path) in self._all:
            raise RuntimeError(f"Added route will never be executed, method {method} is already registered")
        self.added.append((method, path))
        self._all.append((method, path))

    def routes(self) -> list[object]:
        def route(method: str, path: str) -> object:
            resource = types.SimpleNamespace(get_info=lambda: {"path": path})
            return types.SimpleNamespace(method=method, resource=resource)

        return [route(method, path) for method, path in self._all]


def _routes_added_by(owners: set[str], served: tuple[tuple[str, str], ...] = ()) -> set[tuple[str, str]]:
    """The control routes the 0.5 adapter's ``_setup_routes`` hooks of ``owners`` add to a bootstrap server that
    already serves ``served``."""
    from sglang_harden.compat import sglang_v05

    server = types.SimpleNamespace(app=types.SimpleNamespace(router=_Router(served)))
    setup = lambda self: None  # noqa: E731 - SGLang's own routes: none here
    for hook in sglang_v05.HOOKS:
        if hook.qualname.endswith("._setup_routes") and hook.owner in owners:
            setup = hook.make_wrapper(setup)
    setup(server)
    return set(server.app.router.added)


def test_each_guard_installs_its_own_control_routes() -> None:
    """The checksum guard's digest routes exist with abort_notify off (decode reads their 404 as "prefill not
    hardened" and would skip the check), and abort_notify's with the checksum off."""
    from sglang_harden.compat import digest_channel, notify

    digests = {("PUT", digest_channel.DIGEST_PATH), ("GET", digest_channel.DIGESTS_PATH),
               ("GET", digest_channel.FEED_PATH)}
    aborts = {("PUT", notify.ROUTE), ("GET", notify.ROUTE)}
    assert _routes_added_by({"checksum"}) == digests
    assert _routes_added_by({"abort_notify"}) == aborts
    assert _routes_added_by({"abort_notify", "checksum"}) == digests | aborts


def test_a_patched_tree_keeps_its_own_rejection_routes() -> None:
    """On a tree whose backport series already serves ``/pd_rejections`` (same wire format), the plugin adds no
    second route there (aiohttp would refuse it and the bootstrap server would not start)."""
    from sglang_harden.compat import notify

    patched = (("PUT", notify.ROUTE), ("GET", notify.ROUTE))
    assert _routes_added_by({"abort_notify"}, served=patched) == set()


def _tags_hook() -> object:
    from sglang_harden.compat.hooks import Hook

    return Hook("page_tags", "sglang_harden_test_never_imported", "Queue._commit", ("self",), lambda original: original)


def test_page_tags_keeps_its_own_ledger_with_lifecycle_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """page_tags checks pages against decode's page ledger, which the lifecycle hooks keep. With lifecycle off the
    ledger-keeping hooks are armed under their own owner (decode only), so page_tags works alone; with lifecycle on
    they are not armed twice (issue 16; page_tags was not armed at all with lifecycle off before)."""
    from sglang_harden import compat
    from sglang_harden.compat import sglang_v05
    from sglang_harden.compat.hooks import PAGE_LEDGER_OWNER
    from sglang_harden.compat.runtime import RUNTIME
    from sglang_harden.config import Mode

    ledger_hooks = [h for h in sglang_v05.HOOKS if h.owner == PAGE_LEDGER_OWNER]
    assert {h.qualname for h in ledger_hooks} == {
        "Scheduler.__init__", "TokenToKVPoolAllocator.free", "PagedTokenToKVPoolAllocator._release_page_ids",
        "release_kv_cache", "RadixCache.evict", "RadixCache.cache_unfinished_req", "RadixCache.checkpoint",
        "UnifiedRadixCache.evict", "UnifiedRadixCache.cache_unfinished_req", "UnifiedRadixCache.checkpoint",
        "UnifiedRadixCache.evict_for_alloc",
        "BaseTokenToKVPoolAllocator.free_group_begin", "BaseTokenToKVPoolAllocator.free_group_end",
        "PagedTokenToKVPoolAllocator.free_group_end",
        "MooncakeKVReceiver.send_metadata", "NixlKVReceiver.send_metadata", "MoriKVReceiver.send_metadata",
        "DecodeTransferQueue._commit_transfer_to_req"}
    assert sglang_v05.ROLES_BY_OWNER[PAGE_LEDGER_OWNER] == {"decode"}
    registered: list[str] = []
    monkeypatch.setattr(compat.hooks, "register", lambda hook: registered.append(hook.owner))
    monkeypatch.setattr(RUNTIME, "armed", ())
    _with_config(monkeypatch, lifecycle=Mode.OFF, page_tags=Mode.ENFORCE)
    compat._register_enabled([_tags_hook(), *ledger_hooks])
    assert "page_tags" in RUNTIME.armed and "lifecycle" not in RUNTIME.armed
    assert registered.count(PAGE_LEDGER_OWNER) == len(ledger_hooks)
    registered.clear()
    _with_config(monkeypatch, lifecycle=Mode.ENFORCE, page_tags=Mode.ENFORCE)
    compat._register_enabled([_tags_hook(), *ledger_hooks])
    assert PAGE_LEDGER_OWNER not in registered
    registered.clear()
    _with_config(monkeypatch, lifecycle=Mode.OFF, page_tags=Mode.OFF)
    compat._register_enabled([_tags_hook(), *ledger_hooks])
    assert registered == []
