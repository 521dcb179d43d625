"""Guards II (page lifecycle + page tags) on real CPU PD pairs: a late KV write, vanilla vs hardened, per pin and
transfer backend (Mooncake on every pin; NIXL where ci/pins.toml lists it: 0.5.23).

Scenario and oracles: ``sglang_harden.testbed.latewrite`` (the test-only ``latewrite`` shim makes the engine call
for request A give up after 1 s while A's bytes land later, as soon as a victim B decodes over one of A's decode
pages, or, hardened, while a victim sent after A's release time decodes; the decode pool is small enough that
freed pages are reused at once). With NIXL the post of A's KV transfer returns ERR after 1 s
(prefill fails A, tells decode and, on 0.5.23, "poisons" A's drain ack) while the same handle is posted for real
when a victim decodes. Per pin (0.5.19 and 0.5.23 first) and backend:

- vanilla: at least one victim's prompt KV changes while it decodes, or its greedy output differs from the
  quiet-server reference (0.5.19 frees at once; 0.5.23 waits for a drain ack that prefill sends as soon as its
  worker moved on, or for the lowered deferred-release timeout; NIXL 0.5.23 sends no ack for a poisoned room and
  releases at that timeout);
- hardened: 0 corrupted victims, every decode page back at quiesce (nothing left in quarantine), and the
  request whose page was deliberately mis-owned (``misown`` test hook) is aborted with 500, never generated.
  On NIXL the quarantined pages leave on prefill's drain ack, sent once the failed write's lifetime passed.

One pair runs at a time and is always stopped (``run_late_write``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sglang_harden.testbed.envs import get_recipe
from sglang_harden.testbed.latewrite import LateWriteSetup, run_late_write

pytestmark = pytest.mark.e2e

PINS = ["0.5.19", "0.5.23"]
BACKENDS = ["mooncake", "nixl"]


@pytest.fixture(scope="module", params=PINS)
def pin(request: pytest.FixtureRequest, require_pin: Callable[[str], None]) -> str:
    require_pin(request.param)
    return str(request.param)


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest, pin: str) -> str:
    if request.param not in get_recipe(pin).transfer_backends:
        pytest.skip(f"{request.param} is not a transfer backend of {pin} in ci/pins.toml")
    return str(request.param)


@pytest.fixture(scope="module")
def results(pin: str, backend: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root: Path = tmp_path_factory.mktemp(f"latewrite-{pin}-{backend}")
    setup = LateWriteSetup(backend=backend)
    results = {v: run_late_write(pin, v == "hardened", root / v, setup) for v in ("vanilla", "hardened")}
    vanilla = results["vanilla"]
    if not (vanilla["late_write_landed"] and vanilla["corrupted_requests"] >= 1):
        # On a host loaded enough that pairs boot in 4 minutes, no victim may be handed A's pages before the
        # shim's delay ends and the write lands on its own: one more try.
        results["vanilla"] = {**run_late_write(pin, False, root / "vanilla-retry", setup), "attempts": 2}
    return results


def test_vanilla_late_write_corrupts_a_later_request(results: dict[str, dict[str, Any]]) -> None:
    res = results["vanilla"]
    assert res["late_write_landed"], res
    assert res["corrupted_requests"] >= 1, res


def test_hardened_no_corruption_and_pages_back(results: dict[str, dict[str, Any]]) -> None:
    res = results["hardened"]
    assert res["late_write_landed"], res
    assert res["served_requests"] >= 1, res
    assert res["corrupted_requests"] == 0, res
    assert res["pages_back_at_quiesce"], res
    lifecycle = res["decode_pool"]["lifecycle"]
    assert lifecycle["quarantined_pages"] == 0, lifecycle


def test_hardened_misowned_page_is_aborted_not_generated(results: dict[str, dict[str, Any]]) -> None:
    misowned = results["hardened"]["misowned_page_request"]
    assert misowned["status"] == 500, misowned
    assert misowned["output_tokens"] == 0, misowned
    assert "page ownership" in (misowned["error"] or ""), misowned
