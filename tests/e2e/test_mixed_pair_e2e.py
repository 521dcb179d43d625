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
"""

from __future__ import annotations

import secrets
import sys
from pathlib import Path
from typing import Any

import pytest

from sglang_harden.testbed.decisions import decision_lines
from sglang_harden.testbed.incident import KVTRACE_ENV, WAITING_TIMEOUT_ENV, IncidentSetup, RoundResult, run_round
from sglang_harden.testbed.patched import patched_env, patched_tree
from sglang_harden.testbed.pd_topology import PDPair
from sglang_harden.testbed.server import ACTIVATE_ENV, SECRET_FILE_ENV

pytestmark = pytest.mark.e2e

PINS = ["0.5.19"]
VARIANTS = ("patched-prefill", "plugin-prefill")
SETUP = IncidentSetup(waiting_timeout_s=30)
SEEDS = (100, 1)
TOO_LONG = "exceeds the maximum allowed length"
PROMPT_S = 5.0
STARTUP_TIMEOUT_S = 1800.0  # server starts take many minutes on a shared 2-core machine
PLUGIN_ON = {ACTIVATE_ENV: "1"}
_runs: dict[tuple[str, str], dict[str, Any]] = {}


def _progress(msg: str) -> None:
    print(f"[mixed-pair] {msg}", file=sys.stderr, flush=True)


def _secret_file(log_dir: Path) -> Path:
    path = log_dir / "bootstrap.secret"
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return path


def _run(pin: str, variant: str, log_dir: Path, tree: Path) -> dict[str, Any]:
    patched = {**patched_env(tree)}
    prefill_env, decode_env = (patched, PLUGIN_ON) if variant == "patched-prefill" else (PLUGIN_ON, patched)
    env = {WAITING_TIMEOUT_ENV: str(SETUP.waiting_timeout_s), "SGLANG_HARDEN_CAPACITY": "log",
           SECRET_FILE_ENV: str(_secret_file(log_dir))}
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
        logs = {"prefill": pair.prefill.log_text(), "decode": pair.decode.log_text()}
    finally:
        pair.stop()
    return {"rounds": rounds, "logs": logs}


@pytest.fixture(scope="module")
def mixed(require_pin: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    trees: dict[str, Path] = {}

    def get(pin: str, variant: str) -> dict[str, Any]:
        require_pin(pin)
        key = (pin, variant)
        if key not in _runs:  # one start per variant: a failed start is remembered, never retried
            try:
                if pin not in trees:
                    trees[pin] = patched_tree(pin, tmp_path_factory.mktemp(f"tree-{pin}"))
                _runs[key] = _run(pin, variant, tmp_path_factory.mktemp(f"{variant}-{pin}"), trees[pin])
            except Exception as exc:  # noqa: BLE001 - re-raised for every test that needs this run
                _runs[key] = {"error": exc}
        if "error" in _runs[key]:
            raise _runs[key]["error"]
        return _runs[key]

    return get


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("pin", PINS)
def test_decode_hears_the_other_worlds_rejection(mixed: Any, pin: str, variant: str) -> None:
    for rnd in mixed(pin, variant)["rounds"]:
        b = rnd.b
        assert b.prefill.status == 400, b.prefill.summary()
        assert TOO_LONG in b.prefill.error_message()
        assert b.decode.status == 400, b.decode.summary()
        assert TOO_LONG in b.decode.error_message(), b.decode.error_message()
        assert b.decode.elapsed_s < PROMPT_S, f"decode answered B after {b.decode.elapsed_s:.1f}s"
        assert not b.decode.output_ids
        assert rnd.a_rows_read_by_b == 0


@pytest.mark.parametrize("pin", PINS)
def test_each_side_ran_its_own_world(mixed: Any, pin: str) -> None:
    """The patched side logged the patched capacity gate and no plugin decision; the plugin side's decode acted on
    the patched prefill's notice as an ``abort_notify`` decision, and the patched decode logged the plugin
    prefill's notice."""
    one, other = mixed(pin, "patched-prefill")["logs"], mixed(pin, "plugin-prefill")["logs"]
    for patched_log in (one["prefill"], other["decode"]):
        assert "KV pool too small for the configured context" in patched_log
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
