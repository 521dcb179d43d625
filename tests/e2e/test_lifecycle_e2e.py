"""Guards II (page lifecycle + page tags) on real CPU PD pairs: a late KV write, vanilla vs hardened, per pin,
transfer backend (Mooncake on every pin; NIXL where ci/pins.toml lists it: 0.5.23) and testbed profile
(``minimal``: page 1, radix off; ``paged16``: 16-token pages, radix cache, chunked prefill, the pin's early send).

Scenario and oracles: ``sglang_harden.testbed.latewrite`` (the test-only ``latewrite`` shim makes the engine call
for request A give up after 1 s while A's bytes land later, as soon as a victim B decodes over one of A's decode
pages, or, hardened, while a victim sent after A's release time decodes; the decode pool is small enough that
freed pages are reused at once). With NIXL the post of A's KV transfer returns ERR after 1 s
(prefill fails A, tells decode and, on 0.5.23, "poisons" A's drain ack) while the same handle is posted for real
when a victim decodes. Per pin (0.5.19 and 0.5.23 first) and backend:

- vanilla: A's write landed (the shim's replay reported success) and rows of a victim's prompt KV changed while it
  decoded (``context_rows_changed`` > 0: the harm itself, not only a greedy output that differs from the
  quiet-server reference) (0.5.19 frees at once; 0.5.23 waits for a drain ack that prefill sends as soon as its
  worker moved on, or for the lowered deferred-release timeout; NIXL 0.5.23 sends no ack for a poisoned room and
  releases at that timeout);
- hardened: 0 corrupted victims, every decode page back at quiesce (nothing left in quarantine), and the
  request whose page was deliberately mis-owned (``misown`` test hook) is aborted with 500, never generated.
  On NIXL the quarantined pages leave on prefill's drain ack, sent once the failed write's lifetime passed.
  The clean verdict is checked against its own evidence: the fault fired (A's write was replayed and landed, a
  successful status), all of A's pages were quarantined (decode's decision lines), the write landed by the named
  rule while a victim decoded, no victim decoded over one of A's pages
  before it landed, and the KV tracer judged every served victim.

One pair runs at a time and is always stopped (``run_late_write``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sglang_harden.testbed.latewrite import brief, late_write_cases, run_late_write, setup_for, vanilla_harmed

pytestmark = pytest.mark.e2e

PINS = ["0.5.19", "0.5.22", "0.5.23"]
BACKENDS = ["mooncake", "nixl"]
PROFILES = ["minimal", "paged16"]
CASES = late_write_cases(PINS, BACKENDS, PROFILES)


@pytest.fixture(scope="module", params=CASES)
def pin(request: pytest.FixtureRequest, require_pin: Callable[[str], None]) -> str:
    """``<pin>/<transfer backend>/<testbed profile>``; module-scoped: one case's pairs serve all its tests."""
    require_pin(str(request.param))
    return str(request.param)


@pytest.fixture(scope="module")
def results(pin: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    version, backend, profile = pin.split("/")
    root: Path = tmp_path_factory.mktemp(f"latewrite-{version}-{backend}-{profile}")
    setup = setup_for(profile, backend)
    results = {v: run_late_write(version, v == "hardened", root / v, setup) for v in ("vanilla", "hardened")}
    if not vanilla_harmed(results["vanilla"]):
        # On a host loaded enough that pairs boot in 4 minutes, no victim may be handed A's pages before the
        # shim's delay ends and the write lands on its own: one more try.
        results["vanilla"] = {**run_late_write(version, False, root / "vanilla-retry", setup), "attempts": 2}
    for variant, res in results.items():
        print(f"[lifecycle-e2e] {pin} {variant}: late writes {res['late_writes_landed']} landed of "
              f"{res['late_writes_attempted']} attempted ({res['late_writes_failed']} failed), context rows changed "
              f"{res['context_rows_changed']}, corrupted {res['corrupted_requests']} of {res['served_requests']}",
              file=sys.stderr, flush=True)
    return results


def test_vanilla_late_write_corrupts_a_later_request(results: dict[str, dict[str, Any]]) -> None:
    """The control: A's write landed (a successful status, not only replayed) and changed rows of a victim's
    prompt KV while it decoded."""
    res = results["vanilla"]
    assert res["late_writes_landed"] >= 1, brief(res)
    assert res["context_rows_changed"] > 0, brief(res)
    assert res["corrupted_requests"] >= 1, brief(res)


@pytest.mark.proves("plugin", "lifecycle", control="test_vanilla_late_write_corrupts_a_later_request")
def test_hardened_no_corruption_and_pages_back(results: dict[str, dict[str, Any]]) -> None:
    res = results["hardened"]
    assert res["late_writes_attempted"] >= 1, brief(res)  # the fault fired: "0 corrupted" is not vacuous
    assert res["late_writes_landed"] >= 1, brief(res)
    assert res["served_requests"] >= 1, brief(res)
    assert res["corrupted_requests"] == 0, brief(res)
    assert res["pages_back_at_quiesce"], brief(res)


def test_hardened_oracles_saw_what_they_judge(results: dict[str, dict[str, Any]]) -> None:
    """The clean verdict counts only if A's pages really went to quarantine, the write really landed while a
    victim decoded (rule named), no victim was handed one of A's pages before the write landed, and the KV
    tracer judged every served victim (a missing ``context_rows_changed`` is a gap, not a clean row)."""
    res = results["hardened"]
    assert res["a_decode_pages"] and res["a_pages_quarantined"] >= len(res["a_decode_pages"]), brief(res)
    assert res["late_write_trigger_reason"] == "sent after A's release", brief(res)
    assert res["handed_a_pages_before_write_landed"] == [], brief(res)
    assert res["tracer_gaps"] == [], brief(res)
    lifecycle = res["decode_pool"]["lifecycle"]
    assert lifecycle["quarantined_pages"] == 0, lifecycle


def test_hardened_misowned_page_is_aborted_not_generated(results: dict[str, dict[str, Any]]) -> None:
    misowned = results["hardened"]["misowned_page_request"]
    assert misowned["status"] == 500, misowned
    assert misowned["output_tokens"] == 0, misowned
    assert "page ownership" in (misowned["error"] or ""), misowned
