"""The rollout switches: SGLANG_HARDEN_MODE for every guard at once, a mistyped SGLANG_HARDEN_* name refused with
the nearest valid one, an unsupported pin refused with the next step, a patched tree where the plugin stays off."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import sglang_harden
from sglang_harden import compat
from sglang_harden.compat import pins
from sglang_harden.compat.runtime import RUNTIME, HardenRefusal
from sglang_harden.config import (
    ENV_PREFIX,
    GUARDS,
    TESTBED_PREFIX,
    CapacityMode,
    ConfigError,
    Mode,
    load_config,
    setting_names,
)

ROOT = Path(__file__).resolve().parents[2]


def test_mode_log_puts_every_guard_and_the_capacity_gate_in_log_mode() -> None:
    config = load_config({"SGLANG_HARDEN_MODE": "log"})
    assert all(config.mode(guard) is Mode.LOG for guard in GUARDS)
    assert config.capacity is CapacityMode.LOG
    assert load_config({}) == load_config({"SGLANG_HARDEN_MODE": "enforce"})


def test_a_guards_own_variable_overrides_the_mode() -> None:
    config = load_config({"SGLANG_HARDEN_MODE": "log", "SGLANG_HARDEN_PAGE_TAGS": "enforce",
                          "SGLANG_HARDEN_CAPACITY": "clamp"})
    assert config.page_tags is Mode.ENFORCE and config.capacity is CapacityMode.CLAMP
    assert config.lifecycle is Mode.LOG


@pytest.mark.parametrize("value", ["off", "warn", ""])
def test_a_mode_other_than_log_or_enforce_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="SGLANG_HARDEN_MODE.*log, enforce"):
        load_config({"SGLANG_HARDEN_MODE": value})


def test_a_mistyped_variable_is_refused_with_the_nearest_name() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"SGLANG_HARDEN_PAGE_TAG": "log", "SGLANG_HARDEN_QUARANTINE_CAP": "8"})
    message = str(info.value)
    assert "SGLANG_HARDEN_PAGE_TAG (did you mean SGLANG_HARDEN_PAGE_TAGS?)" in message
    assert "SGLANG_HARDEN_QUARANTINE_CAP (did you mean SGLANG_HARDEN_QUARANTINE_CAP_PAGES?)" in message
    with pytest.raises(ConfigError, match="unknown setting SGLANG_HARDEN_XYZZY;"):
        load_config({"SGLANG_HARDEN_XYZZY": "1"})


def test_other_prefixes_and_the_testbed_namespace_pass() -> None:
    load_config({"SGLANG_HARDEN": "x", "SGLANG_HARDENED_X": "1", TESTBED_PREFIX + "LATE_WRITE": "1", "PATH": "/bin"})


def test_every_sglang_harden_name_this_repository_sets_or_reads_is_known() -> None:
    """A name the tools or the test suite put in a server's environment, unknown here, would stop that server."""
    used: set[str] = set()
    for folder in ("sglang_harden", "tests", "scripts", "docs", ".ci"):
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and path.suffix in (".py", ".sh", ".md", "") and "__pycache__" not in path.parts:
                used |= set(re.findall(r"\bSGLANG_HARDEN_[A-Z0-9_]*[A-Z0-9]\b", path.read_text(errors="replace")))
    mistyped_on_purpose = {"SGLANG_HARDEN_PAGE_TAG", "SGLANG_HARDEN_QUARANTINE_CAP", "SGLANG_HARDEN_XYZZY",
                           "SGLANG_HARDEN_CAPACTIY", "SGLANG_HARDENED_X"}
    unknown = {name for name in used - mistyped_on_purpose
               if name not in setting_names() and not name.startswith(TESTBED_PREFIX)}
    assert not unknown, sorted(unknown)
    assert len(used) > 30


def _start_up_hook(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    return subprocess.run([sys.executable, "-c", "from sglang_harden._startup import hook; hook.maybe_install()"],
                          cwd=ROOT, env={**clean, "PYTHONPATH": str(ROOT), "SGLANG_HARDEN_ACTIVATE": "1", **env},
                          capture_output=True, text=True, timeout=60)


def test_a_mistyped_variable_stops_a_process_with_exit_78_naming_it() -> None:
    """The documented outcome (docs/configuration.md): exit 78 (EX_CONFIG), the unknown name and the nearest one.
    Without the mistake, the same process gets past the settings (and stops on the next check: no SGLang here)."""
    refused = _start_up_hook({"SGLANG_HARDEN_CAPACTIY": "clamp"})
    assert refused.returncode == 78, refused.stderr
    assert "SGLANG_HARDEN_CAPACTIY (did you mean SGLANG_HARDEN_CAPACITY?)" in refused.stderr
    spelled_right = _start_up_hook({"SGLANG_HARDEN_CAPACITY": "clamp"})
    assert "unknown setting" not in spelled_right.stderr


def test_an_unsupported_pin_with_a_backport_series_is_refused_naming_patch_apply() -> None:
    with pytest.raises(HardenRefusal) as info:
        compat.family_module_for("0.5.18", allow_unknown=False)
    message = str(info.value)
    assert "sglang-harden patch apply --pin 0.5.18" in message and "pip uninstall sglang-harden" in message
    with pytest.raises(HardenRefusal) as info:
        compat.family_module_for("0.5.14", allow_unknown=False)
    assert "patch apply" not in str(info.value) and "supported pin" in str(info.value)


def test_on_a_patched_tree_the_plugin_stays_off_and_says_what_to_do(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """An unpatched tree of a supported pin arms the plugin's hooks; the same tree with the series' marker file
    arms none and logs the next step."""
    tree = tmp_path / "site"
    (tree / "sglang").mkdir(parents=True)
    (tree / "sglang" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tree))
    monkeypatch.setattr(compat, "installed_sglang_version", lambda: "0.5.23")
    monkeypatch.setattr(compat, "_active", None)
    monkeypatch.setattr(compat, "when_imported", lambda module, callback: None)
    monkeypatch.setattr(compat.hooks, "register", lambda hook: None)
    for attribute in ("config", "pin", "family", "source", "armed"):
        monkeypatch.setattr(RUNTIME, attribute, getattr(RUNTIME, attribute))
    sys.modules.pop("sglang", None)
    try:
        assert pins.patched_tree_marker() is None
        unpatched = compat.activate(source="test")
        assert unpatched.family.startswith("sglang-0.5") and unpatched.hooks
        monkeypatch.setattr(compat, "_active", None)
        marker = tree.joinpath("sglang", *pins.PATCHED_TREE_MARKER)
        marker.parent.mkdir(parents=True)
        marker.write_text("")
        assert pins.patched_tree_marker() == str(marker)
        patched = compat.activate(source="test")
        assert patched.family == compat.PATCHED_TREE and patched.hooks == ()
        assert "pip uninstall sglang-harden" in caplog.text
    finally:
        sys.modules.pop("sglang", None)


def test_docs_configuration_names_every_setting() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert not [name for name in sorted(setting_names()) if f"`{name}`" not in page]


def test_version_on_the_command_line() -> None:
    out = subprocess.run([sys.executable, "-m", "sglang_harden.cli", "--version"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"sglang-harden {sglang_harden.__version__}"
