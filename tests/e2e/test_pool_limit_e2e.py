"""Issue 40 (a): a prompt the node advertises but its paged pool can never admit (paged16 profile, 0.5.23).

Prefill pool 256 tokens, page 16, context 256: SGLang advertises prompts up to 249 tokens (``max_req_input_len``
250), but ``PrefillAdder.add_one_req`` admits a prompt only when ``L + 1 + page_size < pool`` (max_new_tokens is
forced to 1 on prefill), so at most 238 (``guards.capacity.largest_servable_prompt``). Decode (pool 512, 32 reserved
tokens) serves up to 480, so prefill is the tight side. The radix cache is not the cause: with page 1 the same pool
serves 249 tokens, with page 16 and the radix cache off it holds 239 as well.

- vanilla: a 240-token prompt (94 % of the pool) is neither served nor refused; both halves fail once the waiting
  timeout passes; 238 tokens are served; ``sglang-harden audit`` names the configuration
  (``prompt_limit_unservable``, from ``guards.capacity.largest_servable_prompt``).
- hardened: the same pair starts (the capacity gate names the gap in a counted start-up warning), the admission
  doors refuse the 240-token prompt at once with 400 (prefill tells decode, which fails the room without waiting),
  and the 238-token prompt is served.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sglang_harden.testbed.incident import WAITING_TIMEOUT_ENV
from sglang_harden.testbed.pd_topology import PDPair
from sglang_harden.testbed.profiles import get_profile
from sglang_harden.testbed.server import HARDENED_LAUNCHER, VANILLA_LAUNCHER
from sglang_harden.testbed.tools_cli import run_tool

pytestmark = pytest.mark.e2e

PINS = ["0.5.23"]  # 0.5.19 has the same arithmetic (add_one_req); one pin keeps CI time down
PROFILE = get_profile("paged16")
PREFILL_POOL, DECODE_POOL, CONTEXT = 256, 512, 256
SERVABLE, HELD = 238, 240  # PREFILL_POOL - page 16 - 2; 240 fits the context and max_req_input_len (250)
TIMEOUT_S = 10


@pytest.fixture(scope="module", params=PINS)
def pin(request: pytest.FixtureRequest, require_pin: Callable[[str], None]) -> str:
    require_pin(str(request.param))
    return str(request.param)


def _pair(pin: str, tmp_path: Path, *, hardened: bool) -> PDPair:
    return PDPair(pin, prefill_max_total_tokens=PREFILL_POOL, decode_max_total_tokens=DECODE_POOL,
                  context_length=CONTEXT, profile=PROFILE, env={WAITING_TIMEOUT_ENV: str(TIMEOUT_S)}, log_dir=tmp_path,
                  launcher_module=HARDENED_LAUNCHER if hardened else VANILLA_LAUNCHER, startup_timeout=900.0)


def _body(length: int, seed: int) -> dict[str, object]:
    ids = [(i * 7 + 31 * seed) % 400 + 10 for i in range(length)]  # the tiny model's vocabulary is 512
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


def test_vanilla_holds_a_prompt_the_pool_cannot_serve(pin: str, tmp_path: Path) -> None:
    with _pair(pin, tmp_path, hardened=False) as pair:
        assert pair.prefill.server_info()["max_req_input_len"] == 250
        started = time.monotonic()
        held = pair.generate(_body(HELD, 1), timeout=TIMEOUT_S * 4)
        waited = time.monotonic() - started
        served = pair.generate(_body(SERVABLE, 2), timeout=60)
        _, audit = run_tool("audit", pair.prefill.url, pair.decode.url, "--timeout", "20")
    findings = {f["code"]: f for f in audit["findings"]}
    assert "prompt_limit_unservable" in findings and str(SERVABLE) in str(findings["prompt_limit_unservable"]), audit
    assert held.prefill.status != 200 and held.decode.status != 200, (held.prefill.body, held.decode.body)
    assert waited >= 0.8 * TIMEOUT_S, f"answered after {waited:.1f} s: not held"
    assert (served.prefill.status, served.decode.status) == (200, 200), (served.prefill.body, served.decode.body)


@pytest.mark.proves("plugin", "admission", control="test_vanilla_holds_a_prompt_the_pool_cannot_serve")
def test_hardened_refuses_a_prompt_the_pool_cannot_serve_at_once(pin: str, tmp_path: Path) -> None:
    with _pair(pin, tmp_path, hardened=True) as pair:
        assert pair.prefill.server_info()["max_req_input_len"] == 250  # the node starts; the doors refuse the gap
        started = time.monotonic()
        held = pair.generate(_body(HELD, 1), timeout=TIMEOUT_S * 4)
        waited = time.monotonic() - started
        served = pair.generate(_body(SERVABLE, 2), timeout=60)
        decisions = pair.prefill.harden_decisions()
        log = pair.prefill.log_text()
    assert held.prefill.status == 400, (held.prefill.status, held.prefill.body)
    assert held.decode.status != 200, (held.decode.status, held.decode.body)
    assert f"({HELD} tokens)" in str(held.prefill.body) and f"({SERVABLE} tokens" in str(held.prefill.body)
    assert waited < 0.5 * TIMEOUT_S, f"answered after {waited:.1f} s: the refusal waited for the timeout"
    assert (served.prefill.status, served.decode.status) == (200, 200), (served.prefill.body, served.decode.body)
    assert decisions.get("admission:reject", 0) >= 1 and decisions.get("capacity:reject_logged", 0) >= 1, decisions
    assert f"serves at most {SERVABLE}" in log, pair.prefill.log_tail()
