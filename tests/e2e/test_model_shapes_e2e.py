"""The incident on an MLA model (a tiny DeepSeek-V2 shape: ``MLATokenToKVPool``), per CI pin, and the model-shape gate.

The incident's pair (tests/e2e/test_incident.py's sizes, Mooncake, torch_native attention) serving the tiny MLA model
(``testbed/model.py``; dummy weights, seeded: a CPU necessity, no weight file):

- vanilla: what the pin does with the incident on any model (ci/pins.toml ``incident``): on a "leak" pin B is served
  and its first decode step reads the latent rows A left (the KV tracer reads MLA's latent buffers);
- hardened with the defaults: each scheduler reads its pool (MLA), finds guards armed for its role that do not cover
  it (lifecycle; on decode page tags too) and the node refuses to start, naming them and their switches;
- hardened with those two off (the switch the refusal names): A is served with the canary and the digest armed on the
  latent buffers, B is refused at both doors, decode hears of it at once, /server_info shows the shape and each
  guard's cover, both pools are full after.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sglang_harden.testbed.envs import load_pins, plugin_pins
from sglang_harden.testbed.incident import (
    IncidentSetup,
    front_door_round,
    run_incident,
    run_round,
    start_incident_pair,
)
from sglang_harden.testbed.model import TINY_MLA_FLAGS, build_tiny_mla_model
from sglang_harden.testbed.server import ServerError

pytestmark = pytest.mark.e2e

RECIPES = load_pins()
SETUP = IncidentSetup(a_seeds=(1, 2))
UNCOVERED_ON_MLA = {"SGLANG_HARDEN_LIFECYCLE": "off", "SGLANG_HARDEN_PAGE_TAGS": "off"}
HARDEN_ENV = {"SGLANG_HARDEN_CAPACITY": "log"}  # the incident's prefill pool is smaller than its context


@pytest.fixture(scope="module", params=[p for p in plugin_pins() if p in ("0.5.19", "0.5.23")])
def pin(request: pytest.FixtureRequest, require_pin: Any) -> str:
    require_pin(request.param)
    return str(request.param)


@pytest.fixture(scope="module")
def mla(pin: str) -> Path:
    return build_tiny_mla_model(pin)


@pytest.fixture(scope="module")
def vanilla(pin: str, mla: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_incident(pin, setup=SETUP, log_dir=tmp_path_factory.mktemp(f"mla-vanilla-{pin}"),
                        flags=TINY_MLA_FLAGS, model_path=mla)


@pytest.fixture(scope="module")
def covered(pin: str, mla: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The hardened pair with the guards that cover MLA: one round, the front door, /server_info, pools after."""
    pair = start_incident_pair(pin, hardened=True, setup=SETUP, log_dir=tmp_path_factory.mktemp(f"mla-covered-{pin}"),
                               harden_env={**HARDEN_ENV, **UNCOVERED_ON_MLA}, flags=TINY_MLA_FLAGS, model_path=mla)
    try:
        round_ = run_round(pair, 1, 1, SETUP)
        front_door = front_door_round(pair, SETUP)
        shapes = {role: _harden_state(server)["model_shape"] for role, server in
                  (("prefill", pair.prefill), ("decode", pair.decode))}
        quiesce = pair.wait_quiesced(timeout=SETUP.quiesce_timeout_s)
    finally:
        pair.stop()
    return {"round": round_, "front_door": front_door, "shapes": shapes, "quiesce": quiesce}


def _harden_state(server: Any) -> dict[str, Any]:
    states = server.server_info().get("internal_states") or [{}]
    return states[0]["sglang_harden"]


def test_vanilla_mla_pair_does_what_its_pin_does_with_the_incident(pin: str, vanilla: dict[str, Any]) -> None:
    if RECIPES[pin].incident == "leak":
        assert vanilla["verdict"] == "LEAK", json.dumps(vanilla)[:2000]
        for rnd in vanilla["rounds"]:
            assert rnd["b_rows"] == SETUP.b_len and rnd["a_pages_read_by_b"] > SETUP.a_len // 2, rnd
    else:
        assert vanilla["b_prefill_status"] == 400 and vanilla["b_status"] != 200, json.dumps(vanilla)[:2000]
        assert vanilla["verdict"].startswith("rejected; decode held"), vanilla["verdict"]


def test_hardened_mla_node_with_uncovered_guards_refuses_to_start(pin: str, mla: Path, tmp_path: Path) -> None:
    with pytest.raises(ServerError):
        start_incident_pair(pin, hardened=True, setup=SETUP, log_dir=tmp_path, harden_env=HARDEN_ENV,
                            flags=TINY_MLA_FLAGS, model_path=mla)  # stops both servers before it raises
    logs = "".join(path.read_text(errors="replace") for path in tmp_path.glob("*.log"))
    assert ("sglang-harden model-shape gate: refusing to start: this model's KV shape (mla; pool MLATokenToKVPool)"
            in logs), logs[-3000:]
    assert "lifecycle on mla" in logs and "page_tags on mla" in logs
    assert "SGLANG_HARDEN_LIFECYCLE=off SGLANG_HARDEN_PAGE_TAGS=off" in logs
    assert "canary on mla" not in logs and "checksum on mla" not in logs


@pytest.mark.proves("plugin", "admission", control="test_vanilla_mla_pair_does_what_its_pin_does_with_the_incident")
def test_hardened_mla_pair_refuses_b_at_both_doors(covered: dict[str, Any]) -> None:
    rnd = covered["round"]
    assert (rnd.a.prefill.status, rnd.a.decode.status) == (200, 200), (rnd.a.prefill.summary(), rnd.a.decode.summary())
    assert len(rnd.a.decode.output_ids or []) == SETUP.new_tokens, "A served with the canary and digest armed"
    assert rnd.b.prefill.status == 400 and not rnd.b.decode.ok, (rnd.b.prefill.summary(), rnd.b.decode.summary())
    assert rnd.b.decode.elapsed_s < 0.5 * SETUP.waiting_timeout_s, rnd.b.decode.summary()
    assert rnd.a_rows_read_by_b == 0
    door = covered["front_door"]
    assert door["decode_elapsed_s"] < 0.5 * SETUP.waiting_timeout_s and not door["decode_generated"], door


def test_hardened_mla_pair_reports_its_shape_and_covers(covered: dict[str, Any]) -> None:
    for role, shape in covered["shapes"].items():
        assert shape["shapes"] == ["mla"] and shape["read_from"] == ["pool MLATokenToKVPool"], (role, shape)
        guards = shape["guards"]  # the armed guards that run in the role
        assert "lifecycle" not in guards and "page_tags" not in guards, (role, guards)
        assert guards["checksum"] == {"mla": "in-process"}, (role, guards)
        assert guards["admission"] == guards["coverage"] == {"mla": "independent"}, (role, guards)
    assert covered["shapes"]["decode"]["guards"]["canary"] == {"mla": "in-process"}
    assert "canary" not in covered["shapes"]["prefill"]["guards"]  # decode's guard
    assert all(p.get("full") for p in covered["quiesce"].values()), covered["quiesce"]
