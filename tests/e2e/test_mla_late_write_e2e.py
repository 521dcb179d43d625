"""The late write on an MLA pair (the tiny DeepSeek-V2 model, ``MLATokenToKVPool``), vanilla against hardened: the
lifecycle's evidence on MLA (guards/model_shape.py), and the fleet's quarantine alert on a real decode's /metrics.

``testbed/latewrite.py``'s scenario and oracles (paged16 profile, Mooncake) on the MLA model: vanilla's freed latent
pages go to a victim and A's late write changes the victim's latent rows while it decodes; hardened holds A's pages
in quarantine until the write landed (0 corrupted victims, every page back at quiesce, none left in quarantine).
The hardened decode's /metrics, scraped once A's pages are in quarantine, fires SGLangHardenQuarantineNearCap.
CI runs 0.5.23 (ci/pins.toml leaves 0.5.19 to the full run: CI time).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from sglang_harden.testbed import alert_rules
from sglang_harden.testbed.envs import plugin_pins
from sglang_harden.testbed.latewrite import brief, run_late_write, setup_for, vanilla_harmed

pytestmark = pytest.mark.e2e

# A's pages (150 prompt + 8 new tokens, pages of 16: 10) held in quarantine are 83% of a cap two pages larger
# (admission stays open under the cap), so the fleet's quarantine alert is judged on the hardened decode's real
# /metrics as well
_PAGED = setup_for("paged16", "mooncake")
A_PAGES = -(-(_PAGED.a_len + 8) // 16)
LATE_WRITE = dataclasses.replace(_PAGED, model="mla", scrape_quarantine=True, quarantine_cap_pages=A_PAGES + 2)


@pytest.fixture(scope="module", params=[p for p in plugin_pins() if p in ("0.5.19", "0.5.23")])
def pin(request: pytest.FixtureRequest, require_pin: Any) -> str:
    require_pin(request.param)
    return str(request.param)


@pytest.fixture(scope="module")
def late_write(pin: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp(f"mla-latewrite-{pin}")
    results = {v: run_late_write(pin, v == "hardened", root / v, LATE_WRITE) for v in ("vanilla", "hardened")}
    if not vanilla_harmed(results["vanilla"]):  # a loaded host may let the write land before a victim is handed
        results["vanilla"] = {**run_late_write(pin, False, root / "vanilla-retry", LATE_WRITE), "attempts": 2}
    return results


def test_vanilla_mla_late_write_corrupts_a_victim(late_write: dict[str, dict[str, Any]]) -> None:
    res = late_write["vanilla"]
    assert vanilla_harmed(res), brief(res)


@pytest.mark.proves("plugin", "lifecycle", control="test_vanilla_mla_late_write_corrupts_a_victim")
def test_hardened_mla_late_write_corrupts_no_victim(late_write: dict[str, dict[str, Any]]) -> None:
    """The write fired and landed while a victim sent after A's release decoded; no victim was handed A's latent
    pages before it landed, none was corrupted, the tracer judged each, every page came back and none is left in
    quarantine; the request whose page the test hook mis-owned in the ledger was aborted (page tags)."""
    res = late_write["hardened"]
    assert res["late_writes_landed"] >= 1 and res["served_requests"] >= 1, brief(res)
    assert res["late_write_trigger_reason"] == "sent after A's release", brief(res)
    assert res["decode_pool"]["lifecycle"]["quarantined_pages"] == 0, brief(res)
    assert res["corrupted_requests"] == 0 and res["pages_back_at_quiesce"], brief(res)
    assert res["a_pages_quarantined"] == A_PAGES, brief(res)  # all of A's pages (and the alert's sizing)
    assert res["handed_a_pages_before_write_landed"] == [] and res["tracer_gaps"] == [], brief(res)
    misowned = res["misowned_page_request"]
    assert misowned["status"] == 500 and misowned["output_tokens"] == 0, misowned
    assert "page ownership" in (misowned["error"] or ""), misowned


def test_quarantine_alert_fires_on_decodes_metrics_while_the_late_write_is_pending(
    late_write: dict[str, dict[str, Any]], tmp_path: Path,
) -> None:
    """deploy/prometheus's rules over the hardened decode's /metrics, scraped after the warm-up and once A's pages
    were in quarantine: SGLangHardenQuarantineNearCap fires (and promtool agrees with every other alert the two
    scrapes call for)."""
    if alert_rules.promtool() is None:
        pytest.skip("promtool not installed (scripts/fetch_promtool.sh fetches it)")
    pytest.importorskip("yaml")  # the rules' annotations
    before, during = late_write["hardened"]["quarantine_scrapes"]
    assert during is not None, "decode held no page in quarantine within the release window"
    judged = alert_rules.judge_nodes({"decode": (before, during)}, tmp_path)
    assert judged.expected["SGLangHardenQuarantineNearCap"] == [{"instance": "decode", "severity": "warning"}], \
        [line for line in during.splitlines() if "quarantin" in line]
    assert judged.ok, judged.result.stdout + judged.result.stderr
