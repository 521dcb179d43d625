"""Guards on a real SGLang PD pair of the 0.4.9 adapter family (0.4.9.post6, 0.4.10.post2; tiny model, Mooncake
TCP, loopback), vanilla vs hardened.

Each variant starts its own pair once per module, runs its requests, reads both pools, and stops the pair
before any test looks at the result (the pair is stopped also when a request or a start fails):

- ``vanilla`` / ``hardened``: the incident setup (prefill limit 250, decode limit 394). Warm-up, then tenant
  A (200 tokens) and tenant B (300 tokens) twice, then normal requests. Hardened runs through
  ``sglang_harden.launch_server`` with the capacity gate in ``log`` mode (these pools are deliberately
  misconfigured), so the request-path guards are what stop B.
- ``hardened-truncate``: prefill with ``--allow-auto-truncate`` sends KV for 250 of B's 300 tokens while
  decode reserved 300: the admission doors pass, the coverage check must refuse the commit.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from sglang_harden.compat.pins import SUPPORTED_PINS
from sglang_harden.testbed.client import greedy_body
from sglang_harden.testbed.incident import first_decode_event, tenant_a_prompt, tenant_b_prompt
from sglang_harden.testbed.pd_topology import PDPair
from sglang_harden.testbed.server import HARDENED_LAUNCHER, VANILLA_LAUNCHER

pytestmark = pytest.mark.e2e

# the supported pins the 0.4.9 adapter serves; CI builds neither (its pins are 0.5.19 and 0.5.23)
V049_PINS = [pin for pin, family in SUPPORTED_PINS.items() if family == "sglang_v049"]
TOO_LONG = "Input length (300 tokens) exceeds the maximum allowed length (250 tokens)"
A_SEEDS = (100, 1, 2)  # the first round is the warm-up
NORMALS = ((7, 40), (8, 120), (9, 230))  # (seed, prompt length)
NEW_TOKENS = 16
STARTUP_TIMEOUT_S = 1800.0  # a shared 2-core machine under load has needed more than 10 minutes
# 0.4.9 imports its custom all-reduce at start-up, which reads ``sgl_kernel.allreduce`` (absent from the CPU
# stub). On the vLLM branch it probes ``torch.ops._C_custom_ar`` instead, fails, and takes its CPU path.
CPU_ENV = {"USE_VLLM_CUSTOM_ALLREDUCE": "1"}
COMMON_FLAGS: tuple[str, ...] = ()
PREFILL_FLAGS: dict[str, Sequence[str]] = {"hardened-truncate": ("--allow-auto-truncate",)}


def _progress(msg: str) -> None:
    print(f"[guards-v049] {msg}", file=sys.stderr, flush=True)


def _start(pin: str, variant: str, log_dir: Path) -> PDPair:
    hardened = variant.startswith("hardened")
    env = {"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "30", **CPU_ENV}
    if hardened:
        env.update({"SGLANG_HARDEN_ACTIVATE": "1", "SGLANG_HARDEN_CAPACITY": "log"})
    prefill_flags = (*COMMON_FLAGS, *PREFILL_FLAGS.get(variant, ()))
    pair = PDPair(pin, prefill_max_total_tokens=256, decode_max_total_tokens=400, context_length=512,
                  num_reserved_decode_tokens=32, prefill_flags=prefill_flags, decode_flags=COMMON_FLAGS, env=env,
                  decode_env={"SGLANG_HARDEN_TESTBED_KVTRACE_DIR": str(log_dir / "kvtrace")},
                  launcher_module=HARDENED_LAUNCHER if hardened else VANILLA_LAUNCHER, log_dir=log_dir,
                  startup_timeout=STARTUP_TIMEOUT_S, progress=True)
    return pair.start()


def _request(pair: PDPair, rid: str, ids: list[int]) -> dict[str, Any]:
    r = pair.generate(greedy_body(ids, NEW_TOKENS, rid=rid), timeout=150)
    return {"rid": rid, "prefill": r.prefill.summary(), "decode": r.decode.summary(),
            "finish_reason": (r.decode.meta or {}).get("finish_reason")}


def _pool(pair: PDPair) -> dict[str, Any]:
    out = {}
    for server in (pair.prefill, pair.decode):
        state = server.server_info()["internal_states"][0]
        out[server.role] = {"load": state.get("load"), "capacity": state["memory_usage"]["token_capacity"]}
    return out


def _run(pin: str, variant: str, log_dir: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    _progress(f"{variant}: starting the pair (logs {log_dir})")
    pair = _start(pin, variant, log_dir)
    result: dict[str, Any] = {"startup_s": round(time.monotonic() - t0, 1), "rounds": [], "normals": []}
    try:
        for i, seed in enumerate(A_SEEDS):
            a = _request(pair, f"A{i}-s{seed}", tenant_a_prompt(seed, 200))
            b = _request(pair, f"B{i}", tenant_b_prompt(300))
            b["first_decode"] = first_decode_event(log_dir / "kvtrace", f"B{i}")
            result["rounds"].append({"a": a, "b": b})
        for seed, length in NORMALS:
            result["normals"].append(_request(pair, f"N{seed}", tenant_a_prompt(seed, length)))
        time.sleep(2.0)  # let decode finish its idle check_memory() pass
        result["pool"] = _pool(pair)
    finally:
        pair.stop()
    result["logs"] = {s.role: s.log_text() for s in (pair.prefill, pair.decode)}
    _progress(f"{variant}: done in {time.monotonic() - t0:.0f} s")
    return result


@pytest.fixture(scope="module", params=V049_PINS)
def pin(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def run(pin: str, require_pin: Callable[[str], None],
        tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Any]:
    cache: dict[str, dict[str, Any]] = {}

    def get(variant: str) -> dict[str, Any]:
        require_pin(pin)
        if variant not in cache:
            cache[variant] = _run(pin, variant, tmp_path_factory.mktemp(f"{pin}-{variant}"))
        return cache[variant]

    return get


def _measured_b(res: dict[str, Any]) -> list[dict[str, Any]]:
    return [r["b"] for r in res["rounds"][1:]]


def test_vanilla_serves_b_over_pages_it_never_received(run: Any) -> None:
    for b in _measured_b(run("vanilla")):
        assert b["decode"]["status"] == 200 and b["decode"]["completion_tokens"] == NEW_TOKENS, b
        assert b["decode"]["prompt_tokens"] == 300


@pytest.mark.proves("plugin", "admission", control="test_vanilla_serves_b_over_pages_it_never_received")
def test_hardened_rejects_b_with_the_original_error_on_both_halves(run: Any) -> None:
    for b in _measured_b(run("hardened")):
        assert b["prefill"]["status"] == 400 and TOO_LONG in b["prefill"]["error"], b
        assert b["decode"]["status"] == 400 and TOO_LONG in b["decode"]["error"], b
        # Both halves are sent together; decode must answer within 5 s of prefill's rejection.
        assert b["decode"]["elapsed_s"] < b["prefill"]["elapsed_s"] + 5.0, b
        assert b["first_decode"] is None, "decode ran a step for B"


def test_hardened_guards_armed_in_both_schedulers(run: Any, pin: str) -> None:
    logs = run("hardened")["logs"]
    for role in ("prefill", "decode"):
        assert f"sglang-harden active: pin={pin} family=sglang-0.4.9 role=scheduler/{role}" in logs[role]
    assert '"guard": "admission"' in logs["prefill"] and '"guard": "abort_notify"' in logs["decode"]


@pytest.mark.parametrize("variant", ["hardened", "hardened-truncate"])
def test_pools_back_to_full_at_quiesce(run: Any, variant: str) -> None:
    res = run(variant)
    assert res["pool"]["decode"]["load"] == 0 and res["pool"]["prefill"]["load"] == 0, res["pool"]
    assert all("memory leak detected" not in text for text in res["logs"].values())


def test_normal_requests_identical_vanilla_vs_hardened(run: Any) -> None:
    def outputs(res: dict[str, Any]) -> list[Any]:
        reqs = [r["a"] for r in res["rounds"]] + res["normals"]
        return [(r["rid"], r["decode"]["status"], r["decode"]["output_ids"], r["decode"]["logprobs"]) for r in reqs]

    vanilla, hardened = outputs(run("vanilla")), outputs(run("hardened"))
    assert all(status == 200 and len(ids) == NEW_TOKENS for _, status, ids, _ in hardened), hardened
    assert hardened == vanilla


@pytest.mark.proves("plugin", "coverage", control="test_vanilla_serves_b_over_pages_it_never_received")
def test_coverage_refuses_a_short_transfer(run: Any) -> None:
    """Auto-truncate: prefill sends 250 tokens of KV, decode reserved 300; decode must not generate."""
    res = run("hardened-truncate")
    for b in _measured_b(res):
        assert b["prefill"]["status"] == 200, b  # prefill truncated silently (upstream behaviour)
        reason = b["finish_reason"] or {}
        assert reason.get("type") == "abort", b
        assert "sent KV for 250 tokens but decode reserved 300" in reason.get("message", ""), b
        assert (b["decode"]["completion_tokens"] or 0) <= 1 and b["first_decode"] is None, b
    assert '"guard": "coverage"' in res["logs"]["decode"]
