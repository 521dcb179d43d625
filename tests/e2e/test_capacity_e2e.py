"""Capacity gate on a real server: context 512 with a 256-token KV pool (max_req_input_len 250).

- vanilla starts and advertises 512 although no prompt over 250 tokens can ever run (the incident's setup);
- hardened, default (enforce): the server exits non-zero, the log names both numbers and the fixing flags;
- hardened, ``--harden-capacity clamp``: the server starts and advertises the context that fits (256);
- a patched copy of SGLang (``patches/<pin>``, plugin off) with ``SGLANG_HARDEN_CAPACITY=clamp``: the same.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from sglang_harden.testbed.client import http_json
from sglang_harden.testbed.envs import plugin_pins
from sglang_harden.testbed.patched import patched_env, patched_tree
from sglang_harden.testbed.server import HARDENED_LAUNCHER, VANILLA_LAUNCHER, Server, ServerError

pytestmark = pytest.mark.e2e

PINS = plugin_pins()  # the plugin's guards: not on a patch-only release
POOL, CONTEXT, FITTING = 256, 512, 256
GATE_MESSAGE = "sglang-harden capacity gate: KV pool too small for the configured context"
PATCHED_CLAMP_PIN = "0.5.23"  # the 0.5.19 series' gate runs in test_patched_incident.py (log mode)


@pytest.fixture(scope="module", params=PINS)
def pin(request: pytest.FixtureRequest, require_pin: Any) -> str:
    require_pin(request.param)
    return str(request.param)


def _server(pin: str, hardened: bool, tmp_path: Any, extra: list[str] | None = None) -> Server:
    env = {"SGLANG_HARDEN_ACTIVATE": "1"} if hardened else {}
    return Server(pin, "mixed", max_total_tokens=POOL, context_length=CONTEXT, env=env,
                  launcher_module=HARDENED_LAUNCHER if hardened else VANILLA_LAUNCHER,
                  extra_flags=extra or [], log_dir=tmp_path, startup_timeout=900.0)


def _advertised_context(server: Server) -> int:
    status, body = http_json("GET", server.url + "/v1/models", timeout=10.0)
    assert status == 200, body
    return int(body["data"][0]["max_model_len"])


def test_vanilla_advertises_a_context_its_pool_cannot_hold(pin: str, tmp_path: Any) -> None:
    """Also the activation control: the same install with SGLANG_HARDEN_ACTIVATE=0 runs unguarded."""
    with _server(pin, hardened=False, tmp_path=tmp_path) as server:
        assert _advertised_context(server) == CONTEXT
        assert "sglang-harden active" not in server.log_text()
        states = server.server_info().get("internal_states") or [{}]
        assert "sglang_harden" not in states[0], states[0].keys()


@pytest.mark.proves("plugin", "capacity", control="test_vanilla_advertises_a_context_its_pool_cannot_hold")
def test_hardened_refuses_to_start(pin: str, tmp_path: Any) -> None:
    server = _server(pin, hardened=True, tmp_path=tmp_path)
    started = time.monotonic()
    with pytest.raises(ServerError):
        server.start().wait_ready()
    server.stop()
    log = server.log_text()
    assert GATE_MESSAGE in log, server.log_tail()
    assert "max_req_input_len=250" in log and f"context_len={CONTEXT}" in log
    assert "--harden-capacity clamp" in log
    assert server.proc.returncode not in (None, 0), server.proc.returncode
    assert time.monotonic() - started < 900


@pytest.mark.proves("plugin", "capacity", control="test_vanilla_advertises_a_context_its_pool_cannot_hold")
def test_hardened_clamp_starts_with_the_context_that_fits(pin: str, tmp_path: Any) -> None:
    with _server(pin, hardened=True, tmp_path=tmp_path, extra=["--harden-capacity", "clamp"]) as server:
        assert _advertised_context(server) == FITTING
        status, body = http_json("POST", server.url + "/generate", {
            "input_ids": [5] * 300, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}, timeout=60)
        assert status == 400, body


@pytest.mark.proves("patch", "capacity", control="test_vanilla_advertises_a_context_its_pool_cannot_hold")
def test_patched_clamp_starts_with_the_context_that_fits(pin: str, tmp_path: Any) -> None:
    """The backport series' capacity gate means what the plugin's does: clamp starts with the context that fits,
    advertises it, and refuses a longer prompt with 400."""
    if pin != PATCHED_CLAMP_PIN:
        pytest.skip(f"the patched clamp runs on {PATCHED_CLAMP_PIN}")
    tree = patched_tree(pin, tmp_path / "tree")
    env = {**patched_env(tree), "SGLANG_HARDEN_CAPACITY": "clamp"}
    with Server(pin, "mixed", max_total_tokens=POOL, context_length=CONTEXT, env=env,
                launcher_module=VANILLA_LAUNCHER, log_dir=tmp_path, startup_timeout=900.0) as server:
        assert _advertised_context(server) == FITTING
        status, body = http_json("POST", server.url + "/generate", {
            "input_ids": [5] * 300, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}, timeout=60)
        assert status == 400, body
        log = server.log_text()
    assert f"Clamping context_len {CONTEXT} -> {FITTING} (SGLANG_HARDEN_CAPACITY=clamp)" in log
    assert f"advertised context {CONTEXT} -> {FITTING}" in log
    assert "sglang-harden active" not in log
