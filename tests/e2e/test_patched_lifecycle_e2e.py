"""The late KV write on a real PD pair whose SGLang is a patched copy (``patches/<pin>``, series ``page-lifecycle``)
with the plugin OFF.

Same scenario and oracles as ``test_lifecycle_e2e.py`` (``sglang_harden.testbed.latewrite``): the test-only
``latewrite`` shim makes the engine call (Mooncake) or the post (NIXL) of request A's KV give up after 1 s while
A's bytes land later, when a victim sent after A's release time decodes. ``test_lifecycle_e2e.py`` shows the
vanilla pin serving corrupted victims in this very scenario on the same pins and backends; here:

- patched: 0 corrupted victims, the fault fired (A's write replayed) and landed (a successful status) while a
  victim decoded, A's decode pages went to quarantine
  (the series' log line), no victim decoded over one of A's pages before the write landed, every served victim
  judged by the KV tracer, and every decode page back at quiesce (prefill's drain acknowledgement, held for the
  failed write's lifetime, let them out);
- the quarantine cap: with a cap of one page, A's quarantine closes the decode door: victims get 503 with the
  series' reason until prefill's acknowledgement lets A's pages out, and none is corrupted;
- run with ``SGLANG_HARDEN_LIFECYCLE=off`` in the environment (the same tree, the guard switched off), the first
  test fails: the late write corrupts a victim again (how the test was shown to fail without the guard; on 0.5.18,
  which the plugin's test cannot run, this is its vanilla evidence: measured, a victim read 64 rows of A's write).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sglang_harden.testbed.latewrite import brief, late_write_cases, run_late_write, setup_for
from sglang_harden.testbed.patched import patched_tree

pytestmark = pytest.mark.e2e

# 0.4.x and 0.5.10.post1: the patch brings its own abort notice and drain acknowledgement (see patches/README.md)
PINS = ["0.4.9.post6", "0.4.10.post2", "0.5.10.post1", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23"]
BACKENDS = ["mooncake", "nixl"]
PROFILES = ["minimal", "paged16"]  # CI runs paged16 (16-token pages, radix cache, chunked prefill); --profiles all
CASES = late_write_cases(PINS, BACKENDS, PROFILES)


@pytest.fixture(scope="module", params=CASES)
def pin(request: pytest.FixtureRequest, require_pin: Callable[[str], None]) -> str:
    require_pin(str(request.param))
    return str(request.param)


@pytest.fixture(scope="module")
def result(pin: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    version, backend, profile = pin.split("/")
    root: Path = tmp_path_factory.mktemp(f"patched-latewrite-{version}-{backend}-{profile}")
    tree = patched_tree(version, root / "tree")
    return run_late_write(version, False, root / "patched", setup_for(profile, backend), tree=tree)




@pytest.mark.proves(
    "patch", "lifecycle",
    control="tests/e2e/test_lifecycle_e2e.py::test_vanilla_late_write_corrupts_a_later_request",
)
def test_patched_late_write_corrupts_no_request(result: dict[str, Any]) -> None:
    assert result["late_writes_attempted"] >= 1, brief(result)  # the fault fired: "0 corrupted" is not vacuous
    assert result["late_writes_landed"] >= 1, brief(result)
    assert result["served_requests"] >= 1, brief(result)
    assert result["corrupted_requests"] == 0, brief(result)


def test_patched_quarantine_held_a_pages_and_released_them(result: dict[str, Any]) -> None:
    """The clean verdict counts only if A's pages really were quarantined, the write landed while a victim sent
    after A's release decoded, and the pages came back once prefill acknowledged the drain."""
    assert result["a_decode_pages"], brief(result)
    assert result["a_pages_quarantined"] >= len(result["a_decode_pages"]), brief(result)
    assert result["late_write_trigger_reason"] == "sent after A's release", brief(result)
    assert result["handed_a_pages_before_write_landed"] == [], brief(result)
    assert result["tracer_gaps"] == [], brief(result)
    assert result["pages_back_at_quiesce"], brief(result)


CAP_CASE = "0.5.23/mooncake/paged16"


@pytest.fixture(scope="module")
def capped(require_pin: Callable[[str], None], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The scenario on a patched pair whose quarantine cap is one page (prefill gives up on a refused victim's
    handshake after 5 s instead of 300)."""
    require_pin(CAP_CASE)
    version, backend, profile = CAP_CASE.split("/")
    root: Path = tmp_path_factory.mktemp("patched-latewrite-capped")
    setup = dataclasses.replace(setup_for(profile, backend), quarantine_cap_pages=1, prefill_bootstrap_timeout_s=5)
    return run_late_write(version, False, root / "patched", setup, tree=patched_tree(version, root / "tree"))


@pytest.mark.proves(
    "patch", "lifecycle",
    control="tests/e2e/test_lifecycle_e2e.py::test_vanilla_late_write_corrupts_a_later_request",
)
def test_patched_quarantine_cap_refuses_new_requests_with_503(capped: dict[str, Any]) -> None:
    statuses = [v["status"] for v in capped["victims"].values()]
    assert capped["late_writes_attempted"] >= 1, brief(capped)
    assert capped["a_pages_quarantined"] >= 1, brief(capped)
    assert 503 in statuses, brief(capped)
    assert set(statuses) <= {200, 503}, brief(capped)
    decode_log = next(Path(capped["log_dir"]).glob("decode-*.log")).read_text(errors="replace")
    assert "sglang-harden lifecycle reject (503)" in decode_log and "quarantined (cap 1)" in decode_log
    assert capped["corrupted_requests"] == 0, brief(capped)
    assert capped["pages_back_at_quiesce"], brief(capped)
