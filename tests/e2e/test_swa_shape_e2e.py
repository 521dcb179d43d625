"""The model-shape gate on real servers serving a sliding-window model: a tiny Mellum (``testbed/model.py``; dummy
weights, a CPU necessity) whose sliding-window layers SGLang keeps in a second pool with its own indices
(``SWAKVPool``), which the ledger does not track and the canary and digest do not read.

- The control, the rollout mode (``SGLANG_HARDEN_MODE=log``): the hardened PD pair starts on the shape and serves a
  request end to end, with lifecycle, page tags, canary and checksum armed over only part of its KV: each scheduler
  reads its pool as ``swa``, ``/server_info`` names those guards (``partial_in_log_mode``) and the gate's decision
  is counted (``model_shape`` ``reject_logged``). That is what a node with the guards armed does without the gate's
  refusal.
- The defaults (enforce): the same decode node refuses to start, naming the shape, each of those guards and its
  ``SGLANG_HARDEN_<GUARD>=off`` switch.

Per CI pin (CI: 0.5.23; 0.5.19 in the full run). The sliding-window KV's transfer itself is not judged here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sglang_harden.guards.model_shape import PAGE_AND_BYTE_GUARDS, switch_off
from sglang_harden.testbed.client import greedy_body
from sglang_harden.testbed.incident import tenant_a_prompt
from sglang_harden.testbed.model import DUMMY_WEIGHTS, build_tiny_swa_model
from sglang_harden.testbed.pd_topology import PDPair
from sglang_harden.testbed.server import HARDENED_LAUNCHER, Server, ServerError

pytestmark = pytest.mark.e2e

POOL_TOKENS = 1024
CONTEXT = 512
# CPU test speed only: SGLang waits 60 s for CUDA core dumps when a child dies.
FAST_CRASH = {"SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS": "0"}
STARTUP_TIMEOUT_S = 600.0


@pytest.fixture(scope="module", params=["0.5.19", "0.5.23"])
def pin(request: pytest.FixtureRequest, require_pin: Callable[[str], None]) -> str:
    require_pin(request.param)
    return str(request.param)


@pytest.fixture(scope="module")
def swa(pin: str) -> Path:
    return build_tiny_swa_model(pin)


@pytest.fixture(scope="module")
def log_mode_pair(pin: str, swa: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    log_dir = tmp_path_factory.mktemp(f"swa-log-mode-{pin}")
    pair = PDPair(pin, prefill_max_total_tokens=POOL_TOKENS, decode_max_total_tokens=POOL_TOKENS,
                  context_length=CONTEXT, prefill_flags=DUMMY_WEIGHTS, decode_flags=DUMMY_WEIGHTS,
                  env={"SGLANG_HARDEN_MODE": "log"}, launcher_module=HARDENED_LAUNCHER, log_dir=log_dir,
                  model_path=swa, startup_timeout=STARTUP_TIMEOUT_S, progress=True)
    pair.start()
    try:
        result = pair.generate(greedy_body(tenant_a_prompt(3, 80), 16, rid="swa-log-mode"), timeout=240)
        states = {role: server.harden_state() for role, server in (("prefill", pair.prefill),
                                                                   ("decode", pair.decode))}
        return {"result": result, "states": states, "logs": {"decode": pair.decode.log_text()}}
    finally:
        pair.stop()


def test_log_mode_pair_serves_the_swa_shape_with_guards_over_part_of_its_kv(log_mode_pair: dict[str, Any]) -> None:
    result = log_mode_pair["result"]
    assert result.prefill.ok and result.decode.ok and result.decode.output_ids, result.decode.summary()
    for role, state in log_mode_pair["states"].items():
        shape = state["model_shape"]
        assert shape["shapes"] == ["swa"] and shape["read_from"] == ["pool SWAKVPool"], (role, shape)
        assert state["decisions"].get("model_shape:reject_logged", 0) >= 1, (role, state["decisions"])
    decode = log_mode_pair["states"]["decode"]["model_shape"]
    assert set(PAGE_AND_BYTE_GUARDS) <= set(decode["partial_in_log_mode"]), decode
    assert all(decode["guards"][guard] == {"swa": "refused"} for guard in PAGE_AND_BYTE_GUARDS), decode
    # the canary, which cannot stamp this pool, does not pass the request as verified: it fails it closed (log
    # mode: counted, decoded anyway) instead of the scheduler dying at the stamp (found by this test)
    assert "decode's KV pool SWAKVPool cannot be stamped" in log_mode_pair["logs"]["decode"]
    assert log_mode_pair["states"]["decode"]["decisions"].get("canary:abort_logged", 0) >= 1


def test_enforcing_decode_node_refuses_to_start_on_the_swa_shape(pin: str, swa: Path, tmp_path: Path) -> None:
    """The gate's refusal; its control is the log-mode pair above (the model-shape gate is not a matrix guard, so
    no ``proves`` mark: docs/shapes.md cites both tests)."""
    server = Server(pin, "decode", max_total_tokens=POOL_TOKENS, context_length=CONTEXT, model_path=swa,
                    extra_flags=DUMMY_WEIGHTS, env=FAST_CRASH, launcher_module=HARDENED_LAUNCHER, log_dir=tmp_path,
                    startup_timeout=STARTUP_TIMEOUT_S)
    try:
        with pytest.raises(ServerError, match="exited with code"):
            server.start().wait_ready()
    finally:
        server.stop()
    log = server.log_text()
    assert server.proc.returncode != 0, log[-3000:]
    assert "model-shape gate: refusing to start" in log and "(swa; pool SWAKVPool" in log, log[-3000:]
    for guard in PAGE_AND_BYTE_GUARDS:
        assert f"{guard} on swa:" in log and switch_off(guard) in log, (guard, log[-3000:])
