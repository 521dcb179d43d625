"""The incident on an MLA model (a tiny DeepSeek-V2 shape: ``MLATokenToKVPool``) and the model-shape gate, on 0.5.19
and 0.5.23 (CI: 0.5.23, whose vanilla pair refuses B at prefill and holds decode; 0.5.19, whose vanilla pair leaks
the latent rows, in the full run).

The incident's pair (tests/e2e/test_incident.py's sizes, Mooncake, torch_native attention) serving the tiny MLA model
(``testbed/model.py``; dummy weights, seeded: a CPU necessity, no weight file):

- vanilla: what the pin does with the incident on any model (ci/pins.toml ``incident``): on a "leak" pin B is served
  and its first decode step reads the latent rows A left (the KV tracer reads MLA's latent buffers);
- hardened with the defaults (every guard armed: each scheduler reads its pool, MLA, and the model-shape gate finds
  every armed guard covering it): A is served with the canary and the digest armed on the latent buffers, B is
  refused at both doors, decode hears of it at once, /server_info shows the shape and each guard's cover, both pools
  are full after.

After the incident's rounds both pairs get two broken transfers (the test-only ``kvfault`` shim): one bit of one
received latent row flipped before decode commits (room ``FLIP_ROOM``), and a 137-page send that leaves out its last
page and reports success (the incident's stale page). Vanilla decodes over both; hardened, the digest aborts the
first and the canary the second, before any decode step. Last (it leaves the pool inconsistent), a page table pointed
at a free latent page (``table`` fault): vanilla decodes over another request's latent rows; hardened, the page
tags abort.

The late write on the MLA pair, the lifecycle's case: tests/e2e/test_mla_late_write_e2e.py. The gate's refusal of a
shape an armed guard does not cover: on a real sliding-window node in tests/e2e/test_swa_shape_e2e.py, on
speculative decoding in process (tests/integration/test_model_shapes_inprocess.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sglang_harden.testbed.client import greedy_body
from sglang_harden.testbed.envs import load_pins, plugin_pins
from sglang_harden.testbed.incident import (
    KVTRACE_ENV,
    IncidentSetup,
    assert_table_fault_read_by_vanilla,
    front_door_round,
    kvfault_events,
    run_incident,
    run_round,
    start_incident_pair,
    table_fault_round,
    tenant_a_prompt,
)
from sglang_harden.testbed.model import TINY_MLA_FLAGS, build_tiny_mla_model
from sglang_harden.testbed.soak_judging import decision_delta

pytestmark = pytest.mark.e2e

RECIPES = load_pins()
SETUP = IncidentSetup(a_seeds=(1, 2))
FLIP_ROOM = 7_100_001
TABLE_ROOM = 7_100_002
UNWRITTEN_LEN = 137  # page size 1: a send of exactly 137 pages (no other request here sends as many) loses its last
FAULT_ENV = {"SGLANG_HARDEN_TESTBED_KV_FAULT": f"flip:{FLIP_ROOM},unwritten:{UNWRITTEN_LEN},table:{TABLE_ROOM}"}
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
    log_dir = tmp_path_factory.mktemp(f"mla-vanilla-{pin}")
    return run_incident(pin, setup=SETUP, log_dir=log_dir, flags=TINY_MLA_FLAGS, model_path=mla,
                        extra_env=_fault_env(log_dir), more_requests=_every_fault)


@pytest.fixture(scope="module")
def covered(pin: str, mla: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The hardened pair, every guard armed: one round, the front door, the byte faults, /server_info, pools after,
    and the page-table fault last (it leaves the pool inconsistent)."""
    log_dir = tmp_path_factory.mktemp(f"mla-covered-{pin}")
    pair = start_incident_pair(pin, hardened=True, setup=SETUP, log_dir=log_dir, harden_env=HARDEN_ENV,
                               flags=TINY_MLA_FLAGS, model_path=mla, extra_env=_fault_env(log_dir))
    try:
        round_ = run_round(pair, 1, 1, SETUP)
        front_door = front_door_round(pair, SETUP)
        faults = _byte_faults(pair)
        shapes = {role: _harden_state(server)["model_shape"] for role, server in
                  (("prefill", pair.prefill), ("decode", pair.decode))}
        quiesce = pair.wait_quiesced(timeout=SETUP.quiesce_timeout_s)
        faults["table"] = _table_fault(pair)
    finally:
        pair.stop()
    return {"round": round_, "front_door": front_door, "shapes": shapes, "quiesce": quiesce, "faults": faults}


def _fault_env(log_dir: Path) -> dict[str, str]:
    """The faults, and the trace folder for prefill too (the pair gives it to decode): the shim notes there each
    unwritten page prefill's send left out."""
    return {**FAULT_ENV, KVTRACE_ENV: str(log_dir / "kvtrace")}


def _byte_faults(pair: Any) -> dict[str, Any]:
    """The flipped latent bit, then the unwritten page: each answer (its summary), decode's decision counts it added
    (none: vanilla) and the shim's lines saying the fault was made."""
    out: dict[str, Any] = {}
    for name, body, room in (("flip", greedy_body(tenant_a_prompt(31, 120), 8, rid="mla-flipped-bit"), FLIP_ROOM),
                             ("unwritten", greedy_body(tenant_a_prompt(9, UNWRITTEN_LEN), 8, rid="mla-unwritten"),
                              None)):
        before = pair.decode.harden_decisions()
        result = pair.generate(body, room=room, timeout=SETUP.waiting_timeout_s + 120)
        out[name] = {"decode": result.decode.summary(), "made": kvfault_events(pair.log_dir / "kvtrace", name),
                     "decisions": decision_delta(before, pair.decode.harden_decisions())}
    return out


def _table_fault(pair: Any) -> dict[str, Any]:
    before = pair.decode.harden_decisions()
    table = table_fault_round(pair, TABLE_ROOM)
    return {**table, "decisions": decision_delta(before, pair.decode.harden_decisions())}


def _every_fault(pair: Any) -> dict[str, Any]:
    return {**_byte_faults(pair), "table": _table_fault(pair)}


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
        assert guards["lifecycle"] == {"mla": "e2e"}, (role, guards)
        assert guards["checksum"] == {"mla": "e2e"}, (role, guards)
        assert guards["admission"] == guards["coverage"] == {"mla": "independent"}, (role, guards)
    assert covered["shapes"]["decode"]["guards"]["canary"] == {"mla": "e2e"}
    assert covered["shapes"]["decode"]["guards"]["page_tags"] == {"mla": "e2e"}
    assert "canary" not in covered["shapes"]["prefill"]["guards"]  # decode's guards
    assert "page_tags" not in covered["shapes"]["prefill"]["guards"]
    assert all(p.get("full") for p in covered["quiesce"].values()), covered["quiesce"]


def test_vanilla_mla_pair_decodes_over_a_flipped_bit_and_an_unwritten_page(vanilla: dict[str, Any]) -> None:
    faults = vanilla["more_requests"]
    assert [e["rid"] for e in faults["flip"]["made"]] == ["mla-flipped-bit"], faults["flip"]
    assert len(faults["unwritten"]["made"]) == 1 and faults["unwritten"]["made"][0]["pages"] == UNWRITTEN_LEN, \
        faults["unwritten"]
    for name in ("flip", "unwritten"):
        decode = faults[name]["decode"]
        assert decode["status"] == 200 and decode["output_ids"], (name, decode)


@pytest.mark.proves("plugin", "checksum",
                    control="test_vanilla_mla_pair_decodes_over_a_flipped_bit_and_an_unwritten_page")
def test_hardened_mla_digest_aborts_a_flipped_latent_bit(covered: dict[str, Any]) -> None:
    fault = covered["faults"]["flip"]
    assert [e["rid"] for e in fault["made"]] == ["mla-flipped-bit"], fault
    assert fault["decode"]["status"] >= 400 and not fault["decode"]["output_ids"], fault["decode"]
    assert fault["decisions"].get("checksum:abort") == 1, fault["decisions"]


@pytest.mark.proves("plugin", "canary",
                    control="test_vanilla_mla_pair_decodes_over_a_flipped_bit_and_an_unwritten_page")
def test_hardened_mla_canary_aborts_an_unwritten_latent_page(covered: dict[str, Any]) -> None:
    fault = covered["faults"]["unwritten"]
    assert len(fault["made"]) == 1, fault
    assert fault["decode"]["status"] >= 400 and not fault["decode"]["output_ids"], fault["decode"]
    assert "reserved KV pages were never written by its transfer" in (fault["decode"]["error"] or "")
    assert fault["decisions"].get("canary:abort") == 1, fault["decisions"]


def test_vanilla_mla_pair_reads_a_free_latent_page_its_page_table_points_at(
    vanilla: dict[str, Any], covered: dict[str, Any],
) -> None:
    """The kvfault ``table`` fault made once on each pair; vanilla decoded over the free page, reading latent rows
    another request left there."""
    assert_table_fault_read_by_vanilla(vanilla["more_requests"]["table"], covered["faults"]["table"])


@pytest.mark.proves("plugin", "page_tags",
                    control="test_vanilla_mla_pair_reads_a_free_latent_page_its_page_table_points_at")
def test_hardened_mla_page_tags_abort_a_latent_page_the_request_does_not_own(covered: dict[str, Any]) -> None:
    fault = covered["faults"]["table"]
    assert len(fault["table_fault"]) == 1, fault["table_fault"]
    decode = fault["table"].decode
    assert decode.status == 500 and not decode.output_ids, decode.summary()
    assert "page ownership check failed" in decode.error_message(), decode.summary()
    assert fault["decisions"].get("page_tags:abort") == 1, fault["decisions"]
    assert fault["table_first_decode"] is None, fault["table_first_decode"]
