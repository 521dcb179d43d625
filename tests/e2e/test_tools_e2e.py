"""audit against a real CPU PD pair from the testbed (tiny model, Mooncake TCP, loopback): vanilla 0.5.19 with
symmetric pools, where audit finds no sizing problem (``--ignore guards_missing``: vanilla has no guards to show).

The operator tools' other e2e cases run on pairs other modules start anyway (one start fewer each):
- vanilla 0.5.19, asymmetric pools (the incident's setup): audit flags it; probe fails, naming the probe and the
  evidence: ``test_patched_incident.py`` (its vanilla pair);
- hardened, same asymmetric pools, ``--enable-metrics``: probe passes, audit sees the guards, prefill's
  ``/metrics`` counts the admission rejections: ``test_guards_e2e.py`` (its hardened pair, on 0.5.19).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from sglang_harden.testbed.tools_cli import run_tool

pytestmark = pytest.mark.e2e

PIN = os.environ.get("SGLANG_HARDEN_E2E_PIN", "0.5.19")
SYMMETRIC = {"prefill_max_total_tokens": 600, "decode_max_total_tokens": 600, "context_length": 512}


@pytest.fixture(scope="module")
def vanilla_symmetric(require_pin: Any) -> Iterator[Any]:
    from sglang_harden.testbed.pd_topology import PDPair

    require_pin(PIN)
    with PDPair(PIN, progress=True, startup_timeout=900.0, **SYMMETRIC) as pair:
        yield pair


def test_audit_passes_symmetric_pools(vanilla_symmetric: Any) -> None:
    pair = vanilla_symmetric
    code, data = run_tool("audit", pair.prefill.url, pair.decode.url, "--timeout", "20", "--ignore", "guards_missing")
    assert code == 0, data
    assert {f["code"] for f in data["findings"]} == {"guards_missing"}  # vanilla: nothing on /metrics
