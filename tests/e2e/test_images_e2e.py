"""The two images of docs/deploy.md, built from their Dockerfiles without Docker, and a PD pair started from each.

The wheel is built by the command the Dockerfiles name (``python3 -m pip wheel --no-deps -w dist .``); each
Dockerfile's own instructions run on a CPU stand-in of SGLang's official image of the pin
(``sglang_harden/testbed/image_build.py``: the pin's testbed venv without sglang-harden, with pip). Each image's
build-time checks are part of its build (the plugin image: ``--version``, the entry point and start-up hook,
``doctor`` calls the pin supported; the patched image: the series applies and verifies, sglang_harden is not
importable in the result).

- Plugin image: its servers run the image's Python with the testbed's CPU shims only (the checkout is not on
  their path): the wheel's entry point arms the guards in both schedulers, ``/server_info``, ``/metrics``
  (``sglang_harden_build_info``) and the image's ``sglang-harden --version`` name the version, the libraries
  ``build-kernels`` compiled into the image are unchanged after the start (no server warns of a missing one), and a
  request is served.
  Without the wheel in the build context the build stops at its first step (the same Dockerfile, failing).
- Patched image: its servers run the image's Python (plugin absent; the checkout is on their path for the CUDA
  simulator shim only, as in every patched testbed pair): the series' control-plane authentication is on in both
  (their logs) and refuses an unsigned rank registration (401); both logs, ``/server_info``, ``/metrics``
  (``sglang_harden_build_info``, family ``patched``) and the series module's ``--version`` name the series'
  sglang-harden release; the fleet's alert rules see both nodes as protected; a request is served.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

import sglang_harden
from sglang_harden.testbed import alert_rules
from sglang_harden.testbed.client import greedy_body
from sglang_harden.testbed.envs import get_recipe
from sglang_harden.testbed.patched import TESTBED_QUARANTINE_CAP_PAGES
from sglang_harden.testbed.patched_bootstrap import registration
from sglang_harden.testbed.procenv import CHECKOUT, SHIMS_DIR
from sglang_harden.testbed.procenv import testbed_env as pin_environment

pytestmark = pytest.mark.e2e

PIN = os.environ.get("SGLANG_HARDEN_E2E_PIN", "0.5.19")
REPO = Path(__file__).resolve().parents[2]
POOLS = {"prefill_max_total_tokens": 600, "decode_max_total_tokens": 600, "context_length": 512}
METRICS = ["--enable-metrics"]
SUBPROCESS_TIMEOUT_S = 600  # a wheel build or an import of SGLang on a loaded 2-core host, never a hang
BUILD_INFO = re.compile(r'^sglang_harden_build_info\{([^}]*)\} 1(?:\.0)?$', re.M)
TOKENIZER_METRIC = "sglang:prompt_tokens_total"  # one of SGLang's main process's own (its tokenizer's)


def _kernels(home: Path) -> dict[str, float]:
    return {str(p.relative_to(home)): p.stat().st_mtime for p in sorted(home.rglob("*")) if p.is_file()}


def _serve_one(pair: Any) -> list[int]:
    """Decode's output ids of one request (empty where either half failed)."""
    answer = pair.generate(greedy_body(list(range(5, 45)), 4))
    return list(answer.decode.output_ids or []) if answer.prefill.ok and answer.decode.ok else []


def _nodes(pair: Any) -> dict[str, dict[str, Any]]:
    """What the tests read of each node, taken before the pair stops: its sglang-harden block on /server_info, its
    start-up lines, its log and its /metrics."""
    return {role: {"state": node.harden_state(), "armed": node.armed_schedulers(), "log": node.log_text(),
                   "metrics": alert_rules.scrape(node.url)}
            for role, node in (("prefill", pair.prefill), ("decode", pair.decode))}


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(folder), str(REPO)],
                   check=True, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert [p.name for p in folder.iterdir()] == [f"sglang_harden-{sglang_harden.__version__}-py3-none-any.whl"]
    return folder


@pytest.fixture(scope="module")
def plugin_image(require_pin: Any, dist: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The plugin image built, its pair started, read and stopped (one pair of this module at a time)."""
    from sglang_harden.testbed import image_build
    from sglang_harden.testbed.pd_topology import PDPair

    require_pin(PIN)
    image = image_build.build(REPO / "deploy" / "Dockerfile.plugin", PIN, dist,
                              tmp_path_factory.mktemp("plugin-image") / "build")
    home = Path(image.env["SGLANG_HARDEN_HOME"])
    kernels_built = _kernels(home)
    version = subprocess.run([str(image.bin_dir / "sglang-harden"), "--version"], capture_output=True, text=True,
                             timeout=SUBPROCESS_TIMEOUT_S)
    env = {**image.env, "PYTHONPATH": str(SHIMS_DIR), "SGLANG_HARDEN_ACTIVATE": "1"}
    imported = subprocess.run([str(image.python), "-c", "import sglang_harden; print(sglang_harden.__file__)"],
                              capture_output=True, text=True, env={**os.environ, **env}, timeout=SUBPROCESS_TIMEOUT_S)
    with PDPair(PIN, python=image.python, env=env, prefill_flags=METRICS, decode_flags=METRICS, progress=True,
                startup_timeout=900.0, **POOLS) as pair:
        output = _serve_one(pair)
        nodes = _nodes(pair)
    return {"image": image, "home": home, "version": version, "imported": imported, "output": output,
            "kernels_built": kernels_built, "kernels_after": _kernels(home), "nodes": nodes}


@pytest.fixture(scope="module")
def patched_image(require_pin: Any, dist: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The patched image built, its pair started, read and stopped."""
    from sglang_harden.testbed import image_build
    from sglang_harden.testbed.pd_topology import PDPair

    require_pin(PIN)
    image = image_build.build(REPO / "deploy" / "Dockerfile.patched", PIN, dist,
                              tmp_path_factory.mktemp("patched-image") / "build")
    env = {**image.env, "PYTHONPATH": os.pathsep.join(map(str, (SHIMS_DIR, CHECKOUT))),
           "SGLANG_HARDEN_ACTIVATE": "0", "SGLANG_HARDEN_QUARANTINE_CAP_PAGES": TESTBED_QUARANTINE_CAP_PAGES}
    version = subprocess.run([str(image.python), "-m", "sglang.srt.disaggregation.common.pd_auth", "--version"],
                             capture_output=True, text=True, env=pin_environment(get_recipe(PIN), env),
                             timeout=SUBPROCESS_TIMEOUT_S)
    with PDPair(PIN, python=image.python, env=env, prefill_flags=METRICS, decode_flags=METRICS, progress=True,
                startup_timeout=900.0, **POOLS) as pair:
        assert pair.prefill.bootstrap_port is not None
        forged = urllib.request.Request(f"http://127.0.0.1:{pair.prefill.bootstrap_port}/route", method="PUT",
                                        data=json.dumps(dict(registration(1), rank_ip="127.0.0.2")).encode())
        try:
            with urllib.request.urlopen(forged, timeout=10) as answer:
                forged_status = int(answer.status)
        except urllib.error.HTTPError as exc:
            forged_status = int(exc.code)
        output = _serve_one(pair)
        nodes = _nodes(pair)
    return {"image": image, "forged_status": forged_status, "output": output, "version": version, "nodes": nodes}


def test_the_plugin_image_reports_its_version_everywhere(plugin_image: dict[str, Any]) -> None:
    version = sglang_harden.__version__
    assert plugin_image["version"].returncode == 0, plugin_image["version"].stderr
    assert plugin_image["version"].stdout.split() == ["sglang-harden", version], plugin_image["version"].stdout
    for role, node in plugin_image["nodes"].items():
        assert node["state"].get("version") == version, role
        labels = BUILD_INFO.findall(node["metrics"])
        assert labels and all(f'version="{version}"' in found and f'pin="{PIN}"' in found for found in labels), role


def test_the_plugin_image_arms_the_guards_from_its_wheel(plugin_image: dict[str, Any]) -> None:
    image, imported = plugin_image["image"], plugin_image["imported"]
    assert imported.returncode == 0 and Path(imported.stdout.strip()).is_relative_to(image.site_packages), imported
    for role, node in plugin_image["nodes"].items():
        assert node["armed"] and all(scheduler.guards for scheduler in node["armed"]), node["log"][-3000:]
        assert node["state"].get("guards"), role
        assert TOKENIZER_METRIC in node["metrics"], role  # SGLang's own metrics still there
    assert plugin_image["output"], "the plugin image's pair served nothing"


def test_the_plugin_image_servers_load_the_libraries_built_into_it(plugin_image: dict[str, Any]) -> None:
    """The libraries ``build-kernels`` put into the image are there and unchanged after both servers started, and no
    server warned that a library was missing. (The start-up line naming where a library was loaded from is INFO,
    below SGLang's log level; that a server loads a library built before, with no compiler, is
    tests/unit/test_build_kernels.py's.)"""
    built = plugin_image["kernels_built"]
    assert {Path(name).name.split("-")[0] for name in built} >= {"digest", "ledger"}, built
    assert plugin_image["kernels_after"] == built  # nothing rebuilt or added in the image at start-up
    for role, node in plugin_image["nodes"].items():
        assert "run `sglang-harden build-kernels`" not in node["log"], role


def test_the_plugin_image_build_fails_without_the_wheel(require_pin: Any, tmp_path: Path) -> None:
    from sglang_harden.testbed import image_build

    require_pin(PIN)
    empty = tmp_path / "dist"
    empty.mkdir()
    with pytest.raises(image_build.ImageBuildError, match="expected exactly one sglang_harden-"):
        image_build.build(REPO / "deploy" / "Dockerfile.plugin", PIN, empty, tmp_path / "build")


def test_the_patched_image_runs_its_series_without_the_plugin(patched_image: dict[str, Any]) -> None:
    image = patched_image["image"]
    assert (image.site_packages / "sglang" / "srt" / "disaggregation" / "common" / "pd_auth.py").is_file()
    assert not list(image.site_packages.glob("sglang_harden*"))
    for role, log in ((role, node["log"]) for role, node in patched_image["nodes"].items()):
        assert "pd_auth: PD control plane authenticated (enforce mode, 1 secret(s))" in log, role
        assert "sglang-harden active:" not in log, role
        assert f"pd_auth: backport series {sglang_harden.__version__} of sglang-harden" in log, role
    assert patched_image["forged_status"] == 401
    assert patched_image["output"], "the patched image's pair served nothing"


def test_the_patched_image_reports_its_series_everywhere(patched_image: dict[str, Any], tmp_path: Path) -> None:
    """``/server_info`` (the scheduler's ``sglang_harden`` block), ``/metrics`` (the plugin's build-info metric,
    family ``patched``) and the series module's ``--version`` name the series' release, and the fleet's alert rules
    see both nodes as protected (their control: test_tools_e2e.py's vanilla pair)."""
    version = patched_image["version"]
    assert version.returncode == 0 and version.stdout.strip().splitlines()[-1] == (
        f"sglang-harden backport series {sglang_harden.__version__}"), (version.stdout, version.stderr[-2000:])
    for role, node in patched_image["nodes"].items():
        block = node["state"]
        assert block.get("version") == sglang_harden.__version__ and block.get("family") == "patched", block
        assert block.get("control_plane_auth") == "enforce", block
        # the series leaves prometheus_client alone in SGLang's main process: its own metrics stay on /metrics
        assert TOKENIZER_METRIC in node["metrics"], role
    for role, page in ((role, node["metrics"]) for role, node in patched_image["nodes"].items()):
        labels = BUILD_INFO.findall(page)
        assert any(f'version="{sglang_harden.__version__}"' in found and 'family="patched"' in found
                   and f'pin="{PIN}"' in found for found in labels), (role, labels)
    if alert_rules.promtool() is None:
        pytest.skip("promtool not installed (scripts/fetch_promtool.sh fetches it)")
    pytest.importorskip("yaml")  # the rules' annotations
    judged = alert_rules.judge_nodes({role: (None, node["metrics"]) for role, node in patched_image["nodes"].items()},
                                     tmp_path)
    assert judged.expected["SGLangHardenMissing"] == [] and judged.expected["SGLangHardenGuardsNotArmed"] == []
    assert judged.ok, judged.result.stdout + judged.result.stderr
