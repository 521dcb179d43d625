"""audit against a real CPU PD pair from the testbed (tiny model, Mooncake TCP, loopback): vanilla 0.5.19 with
symmetric pools and ``--enable-metrics``, where audit finds no sizing problem (``--ignore guards_missing``: vanilla
has no guards to show), and the fleet's alert rules fire SGLangHardenMissing on both nodes and nothing else (the
control of ``test_guards_e2e.py::test_alert_rules_fire_on_the_hardened_pairs_metrics``).

The operator tools' other e2e cases run on pairs other modules start anyway (one start fewer each):
- vanilla 0.5.19, asymmetric pools (the incident's setup): audit flags it; probe fails, naming the probe and the
  evidence: ``test_patched_incident.py`` (its vanilla pair);
- hardened, same asymmetric pools, ``--enable-metrics``: probe passes, audit sees the guards, prefill's
  ``/metrics`` counts the admission rejections: ``test_guards_e2e.py`` (its hardened pair, on 0.5.19).
"""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sglang_harden.testbed import alert_rules
from sglang_harden.testbed.tools_cli import run_tool

pytestmark = pytest.mark.e2e

PIN = os.environ.get("SGLANG_HARDEN_E2E_PIN", "0.5.19")
SYMMETRIC = {"prefill_max_total_tokens": 600, "decode_max_total_tokens": 600, "context_length": 512}


@pytest.fixture(scope="module")
def vanilla_symmetric(require_pin: Any) -> Iterator[Any]:
    from sglang_harden.testbed.pd_topology import PDPair

    require_pin(PIN)
    metrics = ["--enable-metrics"]
    with PDPair(PIN, progress=True, startup_timeout=900.0, prefill_flags=metrics, decode_flags=metrics,
                **SYMMETRIC) as pair:
        yield pair


def test_audit_passes_symmetric_pools(vanilla_symmetric: Any) -> None:
    pair = vanilla_symmetric
    code, data = run_tool("audit", pair.prefill.url, pair.decode.url, "--timeout", "20", "--ignore", "guards_missing")
    assert code == 0, data
    assert {f["code"] for f in data["findings"]} == {"guards_missing"}  # vanilla: nothing on /metrics


def test_alert_rules_see_a_vanilla_pair_as_unprotected(vanilla_symmetric: Any, tmp_path: Path) -> None:
    if alert_rules.promtool() is None:
        pytest.skip("promtool not installed (scripts/fetch_promtool.sh fetches it)")
    pytest.importorskip("yaml")  # the rules' annotations
    pair = vanilla_symmetric
    series: dict[str, str] = {}
    for instance, node in (("prefill", pair.prefill), ("decode", pair.decode)):
        with urllib.request.urlopen(node.url + "/metrics", timeout=10) as response:
            series.update(alert_rules.series_from_scrapes(None, response.read().decode(), instance))
    assert not any(key.startswith("sglang_harden_") for key in series), sorted(series)
    missing = [{"instance": instance, "severity": "critical"} for instance in ("decode", "prefill")]
    scenario = alert_rules.Scenario("vanilla pair", series, 30, {"SGLangHardenMissing": missing})
    result = alert_rules.run([scenario], tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
