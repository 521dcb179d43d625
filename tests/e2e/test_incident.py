"""The PD incident on real SGLang pairs (tiny model, Mooncake TCP, loopback), per pin, on the ``minimal`` testbed
profile (page 1, radix cache off, no chunking). These are cases of profile ``minimal``: CI runs the same incident
on the production-shaped ``paged16`` profile (``test_paged_profile_e2e.py``: vanilla leak or upstream refusal,
hardened refusal at both doors, the front-door refusal, pools at quiesce; Mooncake and NIXL) and this module with
``--profiles all`` (``SGLANG_HARDEN_TEST_PROFILES=all``).

One scenario run per pin (module-scoped, servers stopped before the tests look at the result):
warm-up round, then rounds with tenant A seeds (1, 2, 1, 2), each round A then the oversized greedy B.

- pins whose ``incident`` in ci/pins.toml is "leak" (0.4.9.post6, 0.5.19): B gets 200 with a full completion, B's output
  depends on A's content and is identical for the same A (black box), and the decode KV tracer sees B's
  first decode step read rows byte-identical to the ones A left (white box). These are real assertions:
  they fail if the leak stops reproducing on a vanilla pin.
- pins with "reject_and_hold" (0.5.20+): records upstream behaviour: prefill answers 400 with the
  length message, decode never answers 200 and holds its reservation until the (lowered) waiting timeout.
- every pin: a request refused at prefill's front door (tokenizer validation) leaves decode holding its
  reservation until the waiting timeout; both allocators are full again once the pair is quiet.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from sglang_harden.testbed.envs import load_pins, plugin_pins
from sglang_harden.testbed.incident import IncidentSetup, run_incident

pytestmark = pytest.mark.e2e

RECIPES = {pin: recipe for pin, recipe in load_pins().items() if pin in plugin_pins()}  # demo: vanilla and hardened
PROFILE = "minimal"
SETUP = IncidentSetup()
LEAK_PINS = [p for p, r in RECIPES.items() if r.incident == "leak"]
HOLD_PINS = [p for p, r in RECIPES.items() if r.incident == "reject_and_hold"]
_results: dict[str, dict[str, Any]] = {}


def _progress(msg: str) -> None:
    print(f"[incident] {msg}", file=sys.stderr, flush=True)


@pytest.fixture(scope="module")
def incident(require_pin: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``incident(pin)`` -> the scenario's summary for that pin (run once per pin per module)."""

    def get(pin: str) -> dict[str, Any]:
        require_pin(f"{pin}/mooncake/{PROFILE}")
        if pin not in _results:
            log_dir: Path = tmp_path_factory.mktemp(f"incident-{pin}")
            _results[pin] = run_incident(pin, hardened=False, setup=SETUP, log_dir=log_dir, progress=_progress)
            _progress(f"{pin}: verdict={_results[pin]['verdict']} timings={_results[pin]['timings_s']}")
        return _results[pin]

    return get


@pytest.mark.parametrize("pin", LEAK_PINS)
def test_vanilla_serves_oversized_prompt(incident: Any, pin: str) -> None:
    res = incident(pin)
    assert res["b_status"] == 200, res["b_decode_error"]
    assert res["b_prompt_tokens"] == SETUP.b_len
    assert res["b_output_ids"] is not None and len(res["b_output_ids"]) == SETUP.new_tokens
    assert res["b_prefill_error"] is None or "exceeds" in res["b_prefill_error"]


@pytest.mark.parametrize("pin", LEAK_PINS)
def test_vanilla_leaks_black_box(incident: Any, pin: str) -> None:
    """B's answer is a function of A's content: different A -> different B, the same A -> the same B."""
    bb = incident(pin)["black_box"]
    assert bb["b_completed_rounds"] == len(SETUP.a_seeds), bb
    assert bb["depends_on_a"], f"B's output did not change with A's content: {bb}"
    assert bb["repeatable"], f"B after the same A differed between repeats: {bb}"


@pytest.mark.parametrize("pin", LEAK_PINS)
def test_vanilla_leaks_white_box(incident: Any, pin: str) -> None:
    """B's first decode step reads KV rows that A wrote (byte-identical to A's rows at A's release)."""
    res = incident(pin)
    for rnd in res["rounds"]:
        assert rnd["b_rows"] == SETUP.b_len, rnd
        assert rnd["a_pages_read_by_b"] > SETUP.a_len // 2, rnd
    assert res["verdict"] == "LEAK"


@pytest.mark.parametrize("pin", HOLD_PINS)
def test_upstream_rejects_at_prefill_but_decode_holds(incident: Any, pin: str) -> None:
    """Observed upstream behaviour on 0.5.20+: prefill 400; decode waits out its timeout, never serves B."""
    res = incident(pin)
    assert res["b_prefill_status"] == 400, res
    assert "exceeds the maximum allowed length" in (res["b_prefill_error"] or ""), res["b_prefill_error"]
    assert res["b_status"] != 200, res
    assert res["b_decode_elapsed_s"] >= 0.8 * SETUP.waiting_timeout_s, res["b_decode_elapsed_s"]
    assert "timed out" in (res["b_decode_error"] or ""), res["b_decode_error"]
    assert res["pages_of_a_read_by_b"] == 0
    assert res["verdict"].startswith("rejected; decode held")


@pytest.mark.parametrize("pin", list(RECIPES))
def test_front_door_refusal_leaves_decode_holding(incident: Any, pin: str) -> None:
    """Prefill's tokenizer refuses a prompt longer than the context; decode, holding a reservation for the
    request, hears nothing and waits out its timeout (every vanilla pin; the 0.4.x pins then even answer 200,
    measured on 0.4.9.post6 and 0.4.10.post2). Hardened: test_guards_e2e."""
    door = incident(pin)["front_door"]
    assert door["prefill"]["status"] == 400 and "context length" in (door["prefill_error"] or ""), door
    assert door["decode_elapsed_s"] >= 0.8 * SETUP.waiting_timeout_s, door
    if not pin.startswith("0.4."):
        assert door["decode_status"] != 200 and not door["decode_generated"], door


@pytest.mark.parametrize("pin", list(RECIPES))
def test_pools_full_at_quiesce(incident: Any, pin: str) -> None:
    assert incident(pin)["pools_full_at_quiesce"], incident(pin)["pools_at_quiesce"]


NIXL_PINS = [p for p, r in RECIPES.items() if "nixl" in r.transfer_backends]


@pytest.mark.parametrize("pin", NIXL_PINS)
def test_nixl_backend_same_upstream_behaviour(require_pin: Any, tmp_path: Path, pin: str) -> None:
    """The same scenario over NIXL (UCX tcp on loopback): A is served over the real transfer, B as on Mooncake."""
    require_pin(f"{pin}/nixl/{PROFILE}")
    res = run_incident(pin, hardened=False, setup=SETUP, log_dir=tmp_path, transfer_backend="nixl", progress=_progress)
    warm = res["warmup"]
    assert (warm["a_prefill_status"], warm["a_decode_status"]) == (200, 200), warm
    expected = RECIPES[pin].incident
    if expected == "leak":
        assert res["verdict"] == "LEAK"
    else:
        assert res["b_prefill_status"] == 400 and res["b_status"] != 200
        assert res["verdict"].startswith("rejected; decode held")


@pytest.mark.proves("plugin", "admission", control="test_nixl_backend_same_upstream_behaviour")
@pytest.mark.parametrize("pin", NIXL_PINS)
def test_nixl_backend_hardened(require_pin: Any, tmp_path: Path, pin: str) -> None:
    """Hardened over NIXL: both schedulers start with the page ledger fed from NIXL's receiver/manager, A is
    served, B refused at both doors, the front-door refusal reaches decode promptly, both pools full after."""
    require_pin(f"{pin}/nixl/{PROFILE}")
    res = run_incident(pin, hardened=True, setup=SETUP, log_dir=tmp_path, transfer_backend="nixl",
                       harden_env={"SGLANG_HARDEN_CAPACITY": "log"}, progress=_progress)
    warm = res["warmup"]
    assert (warm["a_prefill_status"], warm["a_decode_status"]) == (200, 200), warm
    assert (res["b_prefill_status"], res["b_status"]) == (400, 400), res
    assert res["pages_of_a_read_by_b"] == 0 and not res["b_output_ids"]
    door = res["front_door"]
    assert door["decode_status"] == 400 and door["decode_elapsed_s"] < 5.0, door
    assert res["pools_full_at_quiesce"], res["pools_at_quiesce"]
    decode_ledger = res["pools_at_quiesce"]["decode"]["harden_lifecycle"]
    prefill_ledger = res["pools_at_quiesce"]["prefill"]["harden_lifecycle"]
    assert decode_ledger["role"] == "decode" and decode_ledger["quarantined_pages"] == 0, decode_ledger
    assert prefill_ledger["role"] == "prefill" and prefill_ledger["source_pages_held_back"] == 0, prefill_ledger
