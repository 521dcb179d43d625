"""The backport series' settings and stamp, from the modules a patched tree carries (imported from their files):
``SGLANG_HARDEN_MODE`` as every switch's default, a mistyped ``SGLANG_HARDEN_*`` name refused at start with the
nearest name, the plugin's own settings accepted and listed as not read, and the release of sglang-harden that
generated the series, which ``patch verify`` and ``patch apply`` compare with their own. Each case beside its
control (the same module without the setting, or the tree as the series left it)."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import pytest
from test_patch import PATCHES, PINS, load_series_module, make_tree, patched_trees

import sglang_harden
from sglang_harden.config import ENV_PREFIX, OTHER_VARIABLES, TESTBED_PREFIX
from sglang_harden.tools import patch as P

AUTH = "sglang/srt/disaggregation/common/pd_auth.py"
PAGE_TAGS = "sglang/srt/mem_cache/pd_page_tags.py"
PIN = "0.5.19"


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return patched_trees(tmp_path_factory, (PIN,))[PIN]


@pytest.fixture(autouse=True)
def no_harden_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings a server would read out of the way of what each case sets; the harness's own variables stay
    (``SGLANG_HARDEN_HOME`` finds the pin venvs, ``SGLANG_HARDEN_STRICT_SKIPS`` turns an install-caused skip into a
    failure: deleting them once made a case here skip in CI, unnoticed)."""
    harness = {ENV_PREFIX + name for name in OTHER_VARIABLES} - {ENV_PREFIX + "MODE", ENV_PREFIX + "ACTIVATE"}
    for name in list(os.environ):
        if name.startswith(ENV_PREFIX) and name not in harness and not name.startswith(TESTBED_PREFIX):
            monkeypatch.delenv(name)


@pytest.mark.parametrize("pin", PINS)
def test_every_series_is_stamped_with_this_release(pin: str) -> None:
    """A release that changes the version regenerates every series (patches/_source/gen.py)."""
    assert P.series_stamp(P.load_series(pin, PATCHES)) == sglang_harden.__version__


def test_the_rollout_mode_is_every_switchs_default(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_series_module(tree / PAGE_TAGS, "SGLANG_HARDEN_PAGE_TAGS", None, monkeypatch).MODE == "enforce"
    monkeypatch.setenv("SGLANG_HARDEN_MODE", "log")
    assert load_series_module(tree / PAGE_TAGS, "SGLANG_HARDEN_PAGE_TAGS", None, monkeypatch).MODE == "log"
    own = load_series_module(tree / PAGE_TAGS, "SGLANG_HARDEN_PAGE_TAGS", "enforce", monkeypatch)
    assert own.MODE == "enforce"  # a switch's own variable overrides the rollout mode
    monkeypatch.setenv("SGLANG_HARDEN_MODE", "off")  # the rollout switch is log or enforce only
    with pytest.raises(ValueError, match="SGLANG_HARDEN_MODE='off'"):
        load_series_module(tree / PAGE_TAGS, "SGLANG_HARDEN_PAGE_TAGS", None, monkeypatch)


def test_the_rollout_mode_reaches_authentication_only_with_a_secret(tree: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s" * 40 + "\n")
    monkeypatch.setenv("SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE", str(secret))
    enforcing = load_series_module(tree / AUTH, "SGLANG_HARDEN_MODE", None, monkeypatch)
    assert enforcing.AUTH.mode == "enforce"
    assert enforcing.server_info_block()["side_channel_auth"] == "enforce"
    logging_ = load_series_module(tree / AUTH, "SGLANG_HARDEN_MODE", "log", monkeypatch)
    assert logging_.AUTH.mode == "log" and logging_.server_info_block()["side_channel_auth"] == "log"
    monkeypatch.delenv("SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE")
    # without a secret, enforce as the rollout mode is no demand for one (as in the plugin): unauthenticated
    open_ = load_series_module(tree / AUTH, "SGLANG_HARDEN_MODE", "enforce", monkeypatch)
    assert open_.AUTH is None
    block = open_.server_info_block()
    assert block["control_plane_auth"] == block["side_channel_auth"] == "unauthenticated", block


def test_a_mistyped_setting_refuses_to_start_naming_the_nearest(tree: Path, monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("SGLANG_HARDEN_CANARY", "log")
    module = load_series_module(tree / AUTH, "SGLANG_HARDEN_COVERAGE", "off", monkeypatch)  # a plugin setting
    assert module.SERIES_VERSION == sglang_harden.__version__
    monkeypatch.setenv("SGLANG_HARDEN_TESTBED_PIN", PIN)  # the CPU testbed's own, never refused
    with caplog.at_level(logging.INFO):
        load_series_module(tree / AUTH, "SGLANG_HARDEN_COVERAGE", "off", monkeypatch)
    assert re.search(r"not read by the backport series \(plugin settings\): .*SGLANG_HARDEN_COVERAGE", caplog.text)
    nearest = r"unknown setting SGLANG_HARDEN_CAPACTIY \(did you mean SGLANG_HARDEN_CAPACITY\?\)"
    with pytest.raises(Exception, match=nearest):
        load_series_module(tree / AUTH, "SGLANG_HARDEN_CAPACTIY", "log", monkeypatch)


def test_verify_and_apply_name_a_tree_of_another_series(tmp_path: Path) -> None:
    tree = make_tree(PIN, tmp_path / "tree")
    P.apply_series(tree, PIN)
    report = P.verify_series(tree, PIN)
    assert report.ok and report.tree_series_version == report.series_version == sglang_harden.__version__
    assert f"the series of sglang-harden {sglang_harden.__version__}" in report.message
    stamped = tree / AUTH
    stamped.write_text(stamped.read_text().replace(f"SERIES_VERSION = '{sglang_harden.__version__}'",
                                                   "SERIES_VERSION = '0.0.1'"))
    other = P.verify_series(tree, PIN)
    assert not other.ok and other.tree_series_version == "0.0.1"
    assert "carries the series of sglang-harden 0.0.1" in other.message, other.message
    with pytest.raises(P.PatchError, match="carries the series of sglang-harden 0.0.1") as refused:
        P.apply_series(tree, PIN)
    assert refused.value.code == P.EXIT_REJECT


def test_doctor_names_the_series_a_tree_carries(tmp_path: Path) -> None:
    from sglang_harden.tools import doctor

    tree = make_tree(PIN, tmp_path / "tree")
    assert doctor.series_state(tree) == {}  # pristine: no series
    P.apply_series(tree, PIN)
    assert doctor.series_state(tree) == {"carried": sglang_harden.__version__,
                                         "this_release": sglang_harden.__version__, "current": True}
    stamped = tree / AUTH
    stamped.write_text(stamped.read_text().replace(f"SERIES_VERSION = '{sglang_harden.__version__}'",
                                                   "SERIES_VERSION = '0.0.1'"))
    assert doctor.series_state(tree)["current"] is False


def test_the_build_info_labels_are_the_plugins(tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a patched node puts on ``/metrics`` (tests/e2e/test_images_e2e.py scrapes it from a real pair): the
    plugin's label names, family ``patched``, and the mode summed up as the plugin does."""
    from sglang_harden import events

    module = load_series_module(tree / AUTH, "SGLANG_HARDEN_MODE", None, monkeypatch)
    labels = module.build_info_labels(None)
    assert tuple(labels) == events.BUILD_INFO_LABELS
    assert labels | {"pin": "x"} == {"version": sglang_harden.__version__, "pin": "x", "family": "patched",
                                     "role": "scheduler", "mode": "enforce"}
    monkeypatch.setenv("SGLANG_HARDEN_MODE", "log")  # the patches without a switch still enforce
    assert module.build_info_labels(None)["mode"] == "mixed"
    for name in module.MODE_SWITCHES:
        monkeypatch.setenv(name, "off")
    assert module.build_info_labels(None)["mode"] == "enforce"


def test_the_build_info_is_published_only_where_sglang_set_up_its_metrics(tree: Path, tmp_path: Path) -> None:
    """SGLang's main process imports the series' pd_auth before it sets ``PROMETHEUS_MULTIPROC_DIR``; importing
    prometheus_client there would keep the main process's own metrics off ``/metrics`` (it picks its storage at
    import). So without the variable the module leaves prometheus_client alone; with it (a scheduler) it publishes.
    Run in a pin's interpreter, which has prometheus_client."""
    import subprocess

    from sglang_harden.testbed.envs import ci_pins, is_built, venv_python

    pin = ci_pins()[0]
    if not is_built(pin):
        pytest.skip(f"no pin venv for {pin} (scripts/setup_envs.sh {pin})")
    probe = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('pd_auth_probe', sys.argv[1]);"
             " module = importlib.util.module_from_spec(spec); sys.modules[spec.name] = module;"
             " spec.loader.exec_module(module); print('prometheus_client' in sys.modules)")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_HARDEN_", "PROMETHEUS_"))}
    seen = {}
    for label, extra in (("main process", {}), ("scheduler", {"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})):
        done = subprocess.run([str(venv_python(pin)), "-c", probe, str(tree / AUTH)], capture_output=True, text=True,
                              env={**clean, **extra}, timeout=120)
        assert done.returncode == 0, done.stderr
        seen[label] = done.stdout.strip()
    assert seen == {"main process": "False", "scheduler": "True"}, seen
    assert any(tmp_path.iterdir()), "no multiprocess sample file: the gauge was not written"
