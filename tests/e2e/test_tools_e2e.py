"""audit against a real CPU PD pair from the testbed (tiny model, Mooncake TCP, loopback): 0.5.19 with the plugin
installed and every guard set to off (what a fleet looks like after a careless rollback), symmetric pools and
``--enable-metrics``. audit finds no sizing problem, only the unauthenticated control plane and side channels (the
capacity gate, which has its own switch, still decides, so audit does not call the pair unguarded); the fleet's
alert rules fire
SGLangHardenGuardsNotArmed on both nodes and nothing else (its control: every hardened pair the alert cases judge,
where it stays silent; SGLangHardenMissing's vanilla control is ``test_paged_profile_e2e.py``'s vanilla pair).

The operator tools' other e2e cases run on pairs other modules start anyway (one start fewer each):
- vanilla 0.5.19, asymmetric pools (the incident's setup): audit flags it; probe fails, naming the probe and the
  evidence: ``test_patched_incident.py`` (its vanilla pair);
- hardened, same asymmetric pools, ``--enable-metrics``: probe passes, audit sees the guards, prefill's
  ``/metrics`` counts the admission rejections: ``test_guards_e2e.py`` (its hardened pair, on 0.5.19).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sglang_harden.testbed import alert_rules
from sglang_harden.testbed.tools_cli import run_tool

pytestmark = pytest.mark.e2e

PIN = os.environ.get("SGLANG_HARDEN_E2E_PIN", "0.5.19")
SYMMETRIC = {"prefill_max_total_tokens": 600, "decode_max_total_tokens": 600, "context_length": 512}


# Nothing it would refuse: the findings that say so, and the one that says nothing guards the pair
UNPROTECTED = {"guards_missing", "control_plane_unauthenticated", "side_channels_unauthenticated"}


@pytest.fixture(scope="module")
def unguarded_symmetric(require_pin: Any) -> Iterator[Any]:
    from sglang_harden.config import GUARDS
    from sglang_harden.testbed.pd_topology import PDPair

    require_pin(PIN)
    metrics = ["--enable-metrics"]
    every_guard_off = {"SGLANG_HARDEN_ACTIVATE": "1", **{f"SGLANG_HARDEN_{guard.upper()}": "off" for guard in GUARDS}}
    with PDPair(PIN, progress=True, startup_timeout=900.0, prefill_flags=metrics, decode_flags=metrics,
                env=every_guard_off, **SYMMETRIC) as pair:
        yield pair


def test_audit_passes_symmetric_pools(unguarded_symmetric: Any) -> None:
    pair = unguarded_symmetric
    ignored = [arg for code in sorted(UNPROTECTED) for arg in ("--ignore", code)]
    code, data = run_tool("audit", pair.prefill.url, pair.decode.url, "--timeout", "20", *ignored)
    assert code == 0, data
    codes = {f["code"] for f in data["findings"]}
    assert "control_plane_unauthenticated" in codes and codes <= UNPROTECTED, codes  # no sizing finding


def test_alert_rules_see_an_unguarded_pair(unguarded_symmetric: Any, tmp_path: Path) -> None:
    if alert_rules.promtool() is None:
        pytest.skip("promtool not installed (scripts/fetch_promtool.sh fetches it)")
    pytest.importorskip("yaml")  # the rules' annotations
    pair = unguarded_symmetric
    scrapes = {role: (None, alert_rules.scrape(node.url)) for role, node in (("prefill", pair.prefill),
                                                                              ("decode", pair.decode))}
    judged = alert_rules.judge_nodes(scrapes, tmp_path)
    unarmed = judged.expected["SGLangHardenGuardsNotArmed"]
    assert {labels["instance"] for labels in unarmed} == {"decode", "prefill"}, unarmed
    assert not any(labels for alert, labels in judged.expected.items() if alert != "SGLangHardenGuardsNotArmed")
    assert judged.ok, judged.result.stdout + judged.result.stderr
