"""The plugin entry point refuses to let a process serve when arming fails, whatever the failure.

SGLang's ``load_plugins()`` runs each plugin under ``except Exception`` and carries on, so an exception that
escapes ``load()`` would leave the server running unguarded; only SystemExit gets through that handler."""

from __future__ import annotations

import pytest

from sglang_harden import compat, plugin
from sglang_harden.compat.hooks import HookInstallError
from sglang_harden.compat.runtime import HardenRefusal


def _swallowing_loader() -> None:
    """What SGLang's load_plugins does with a general plugin."""
    try:
        plugin.load()
    except Exception:  # noqa: BLE001 - SGLang's own handler
        pass


@pytest.mark.parametrize("failure", [
    HardenRefusal("sglang-harden: SGLang 0.5.99 is not a supported pin"),
    HookInstallError("sglang.srt.disaggregation.decode.DecodePreallocQueue.add: not found"),
    ImportError("a module of ours could not be imported"),
])
def test_any_arming_failure_exits_78(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                     failure: Exception) -> None:
    def activate(source: str) -> None:
        raise failure

    monkeypatch.delenv("SGLANG_HARDEN_ACTIVATE", raising=False)
    monkeypatch.setattr(compat, "activate", activate)
    with pytest.raises(SystemExit) as exit_info:
        _swallowing_loader()
    assert exit_info.value.code == plugin.REFUSED_EXIT_CODE == 78
    assert f"refusing to run unguarded: {failure}" in capsys.readouterr().err


def test_disabled_plugin_does_not_arm(monkeypatch: pytest.MonkeyPatch) -> None:
    def activate(source: str) -> None:
        raise AssertionError("must not be called")

    monkeypatch.setenv("SGLANG_HARDEN_ACTIVATE", "0")
    monkeypatch.setattr(compat, "activate", activate)
    plugin.load()
