"""A fleet half on the backport patches, half on the plugin: one wire format, so each side hears the other.

Two real PD pairs on one pin, each prefill and decode from different worlds:
- ``patched-prefill``: prefill runs a patched copy of SGLang with the plugin off, decode runs the pin's own SGLang
  with the plugin armed;
- ``plugin-prefill``: the reverse.

Both pairs share a control-plane secret file (the patches and the plugin sign and check the same token). The
incident's pools are too small for the context, so both capacity gates run in log mode. Rounds: tenant A (200
tokens) then tenant B (300 tokens; prefill's limit 250, decode's 394). In both pairs:
- B is refused by prefill with its original "exceeds the maximum allowed length" (HTTP 400), and decode, told
  through ``/pd_rejections`` by the other world's code, answers the same within seconds instead of its waiting
  timeout, with no completion and no row of A's KV read;
- A completes with the same greedy output in both pairs: each side's coverage count (``channels/coverage_wire``)
  is accepted by the other's check.
Before this wire format was shared, a patched prefill's notice never reached a plugin decode (B waited out the
30 s timeout and got a 500) and each side's coverage check refused the other's transfers.

The patched decode beside the plugin prefill verifies the plugin prefill's KV digests (one digest wire format).
The plugin decode beside the patched prefill runs with ``--harden-lifecycle off`` and the KV digest off (so that
page tags alone judge the fault below) and page tags on: the page-tag guard
keeps its own page ledger then (issue 16; it used to be unarmed without lifecycle). Last, SGLang's own page table
of one request is pointed at a free page (test-only ``kvfault`` ``table``): page tags refuse it (500) before the
first decode step.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from sglang_harden.testbed.client import greedy_body
from sglang_harden.testbed.decisions import decision_lines
from sglang_harden.testbed.incident import (
    KVTRACE_ENV,
    WAITING_TIMEOUT_ENV,
    IncidentSetup,
    RoundResult,
    assert_b_refused_at_both_doors,
    run_round,
    tenant_a_prompt,
)
from sglang_harden.testbed.memo import run_once
from sglang_harden.testbed.patched import patched_env, patched_tree
from sglang_harden.testbed.pd_topology import PDPair
from sglang_harden.testbed.server import ACTIVATE_ENV

pytestmark = pytest.mark.e2e

PINS = ["0.5.19"]
VARIANTS = ("patched-prefill", "plugin-prefill")
SETUP = IncidentSetup(waiting_timeout_s=30)
SEEDS = (100, 1)
TOO_LONG = "exceeds the maximum allowed length"
PROMPT_S = 5.0
STARTUP_TIMEOUT_S = 1800.0  # server starts take many minutes on a shared 2-core machine
PLUGIN_ON = {ACTIVATE_ENV: "1"}  # ZMQ side channels in enforce on both worlds: one auth frame (sghz1)
TABLE_ROOM = 993_000_001
# the plugin decode beside a patched prefill: lifecycle off, page tags on, and the page-table fault for one room; the
# KV digest off too, so that page tags alone judge that room (the patched prefill publishes digests since the
# kv-digest patch, and the plugin decode's digest then refuses the fault first: seen in CI)
TAGS_ALONE = {"SGLANG_HARDEN_LIFECYCLE": "off", "SGLANG_HARDEN_CHECKSUM": "off",
              "SGLANG_HARDEN_TESTBED_KV_FAULT": f"table:{TABLE_ROOM}"}
_runs: dict[tuple[str, str], dict[str, Any]] = {}


def _progress(msg: str) -> None:
    print(f"[mixed-pair] {msg}", file=sys.stderr, flush=True)


def _run(pin: str, variant: str, log_dir: Path, tree: Path) -> dict[str, Any]:
    patched = {**patched_env(tree)}
    prefill_env, decode_env = ((patched, {**PLUGIN_ON, **TAGS_ALONE}) if variant == "patched-prefill"
                               else (PLUGIN_ON, patched))
    # no secret file set here: the testbed gives every server its control-plane secret (server.testbed_secret)
    env = {WAITING_TIMEOUT_ENV: str(SETUP.waiting_timeout_s), "SGLANG_HARDEN_CAPACITY": "log"}
    _progress(f"{pin} {variant}: starting pair (logs {log_dir})")
    pair = PDPair(
        pin, prefill_max_total_tokens=SETUP.prefill_max_total_tokens,
        decode_max_total_tokens=SETUP.decode_max_total_tokens, context_length=SETUP.context_length,
        num_reserved_decode_tokens=SETUP.num_reserved_decode_tokens, env=env, prefill_env=prefill_env,
        decode_env={**decode_env, KVTRACE_ENV: str(log_dir / "kvtrace")}, log_dir=log_dir,
        startup_timeout=STARTUP_TIMEOUT_S, progress=True,
    ).start()
    rounds: list[RoundResult] = []
    try:
        for index, seed in enumerate(SEEDS):
            rounds.append(run_round(pair, index, seed, SETUP, tag=f"{variant}-"))
            b = rounds[-1].b
            _progress(f"{pin} {variant} round {index}: B prefill {b.prefill.status} decode {b.decode.status} "
                      f"in {b.decode.elapsed_s:.2f}s ({b.decode.error_message()[:80] if not b.decode.ok else 'ok'})")
        table = None
        if variant == "patched-prefill":  # last: the fault leaves decode's pool inconsistent
            table = pair.generate(greedy_body(tenant_a_prompt(21, 120), 8, rid="table-fault"), room=TABLE_ROOM,
                                  timeout=SETUP.waiting_timeout_s + 120)
        logs = {"prefill": pair.prefill.log_text(), "decode": pair.decode.log_text()}
        armed = {"prefill": pair.prefill.armed_schedulers(), "decode": pair.decode.armed_schedulers()}
    finally:
        pair.stop()
    return {"rounds": rounds, "logs": logs, "table": table, "armed": armed}


@pytest.fixture(scope="module")
def mixed(require_pin: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    trees: dict[str, Path] = {}

    def make(pin: str, variant: str) -> dict[str, Any]:
        if pin not in trees:
            trees[pin] = patched_tree(pin, tmp_path_factory.mktemp(f"tree-{pin}"))
        return _run(pin, variant, tmp_path_factory.mktemp(f"{variant}-{pin}"), trees[pin])

    def get(pin: str, variant: str) -> dict[str, Any]:
        require_pin(pin)
        return run_once(_runs, (pin, variant), lambda: make(pin, variant))

    return get


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("pin", PINS)
def test_decode_hears_the_other_worlds_rejection(mixed: Any, pin: str, variant: str) -> None:
    for rnd in mixed(pin, variant)["rounds"]:
        assert_b_refused_at_both_doors(rnd, PROMPT_S)


@pytest.mark.parametrize("pin", PINS)
def test_each_side_ran_its_own_world(mixed: Any, pin: str) -> None:
    """The patched side logged the patched capacity gate and no plugin decision; the plugin side's decode acted on
    the patched prefill's notice as an ``abort_notify`` decision, and the patched decode logged the plugin
    prefill's notice."""
    one, other = mixed(pin, "patched-prefill")["logs"], mixed(pin, "plugin-prefill")["logs"]
    for patched_log in (one["prefill"], other["decode"]):
        assert "KV pool too small for the configured context" in patched_log
        assert "pd_auth: PD control plane authenticated (enforce mode, 1 secret(s))" in patched_log
        assert not decision_lines(patched_log)
    told = [d for d in decision_lines(one["decode"])
            if d.get("guard") == "abort_notify" and d.get("decision") == "abort"]
    assert len(told) >= len(SEEDS), told
    assert "pd_rejections: prefill" in other["decode"]
    assert any(d.get("guard") == "admission" for d in decision_lines(other["prefill"]))


@pytest.mark.parametrize("pin", PINS)
def test_normal_requests_pass_both_coverage_checks(mixed: Any, pin: str) -> None:
    """A's transfer is checked by the other world's coverage code in each pair, and passes, with one output."""
    outputs = []
    for variant in VARIANTS:
        for rnd in mixed(pin, variant)["rounds"]:
            assert rnd.a.decode.ok, (variant, rnd.a.decode.summary())
            assert len(rnd.a.decode.output_ids or []) == SETUP.new_tokens
        outputs.append([rnd.a.decode.output_ids for rnd in mixed(pin, variant)["rounds"]])
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("pin", PINS)
def test_patched_decode_verifies_the_plugin_prefills_digests(mixed: Any, pin: str) -> None:
    """The plugin prefill posts its KV digests on its bootstrap server; the patched decode beside it fetches and
    compares them for every transfer (it would log a skip for a prefill that publishes none) and serves A."""
    run = mixed(pin, "plugin-prefill")
    assert all(rnd.a.decode.ok for rnd in run["rounds"]), [rnd.a.decode.summary() for rnd in run["rounds"]]
    assert "sglang-harden checksum skip" not in run["logs"]["decode"]
    assert "sglang-harden checksum abort" not in run["logs"]["decode"]


@pytest.mark.parametrize("pin", PINS)
def test_page_tags_guard_alone_with_lifecycle_off(mixed: Any, pin: str) -> None:
    run = mixed(pin, "patched-prefill")
    armed = run["armed"]["decode"]
    assert armed and all("page_tags" in s.guards and "lifecycle" not in s.guards for s in armed), armed
    table = run["table"].decode
    assert table.status == 500 and not table.output_ids, table.summary()
    assert "page ownership check failed" in table.error_message(), table.summary()
    refused = [d for d in decision_lines(run["logs"]["decode"])
               if d.get("guard") == "page_tags" and d.get("decision") == "abort"]
    assert len(refused) == 1, refused
    assert not [d for d in decision_lines(run["logs"]["decode"]) if d.get("guard") == "lifecycle"]
