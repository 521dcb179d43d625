"""The hot path under the CUDA simulator on real PD pairs: sglang-harden adds no host synchronisation to either
scheduler thread per request, never reads what SGLang has not finished copying, and the guards still run.

Per CI pin, a pair on the production-shaped profile ``paged16`` (16-token pages, the radix cache, 64-token chunks,
the pin's own early send of cached prefixes) serves a benign concurrent workload: requests sharing a 64-token
system prompt (radix hits, chunked prefill, duplicates freed while chunks are in flight) from four clients. Once with
the plugin (``sglang_harden.launch_server``, every guard on) and once as a patched tree (the pin's backport series,
plugin off). The simulator (shim ``cuda_sim``, on every pin: ``ci/pins.toml``) treats what SGLang places on its
device as GPU memory and counts, per owner, every operation that would make the host wait for a stream, and every
read of a pinned copy before its event.

Asserted per role (prefill, decode), between a snapshot after the warm-up and one after the workload:

- no host synchronisation and no thread wait by sglang-harden, per request; SGLang's own are counted in the same
  run (the counter works: the control that it can fire);
- no poisoned read by anyone since start-up (the hardened prefill's source hold read 0.5.21+'s page indices before
  their copy landed, 3 times per request, before this was fixed);
- the guards ran: on decode the canary and the digest allowed every request and the pools are full at quiesce.

On the code before the GPU-true hot path this module fails (issue 38's note has the run).
"""

from __future__ import annotations

import concurrent.futures
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sglang_harden.testbed.client import greedy_body
from sglang_harden.testbed.cudasim_report import HARDEN, owner_rows, per_request, sim_state
from sglang_harden.testbed.envs import ci_pins
from sglang_harden.testbed.memo import run_once
from sglang_harden.testbed.patched import patched_env, patched_tree
from sglang_harden.testbed.pd_topology import PDPair
from sglang_harden.testbed.profiles import get_profile
from sglang_harden.testbed.server import HARDENED_LAUNCHER, SECRET_FILE_ENV, VANILLA_LAUNCHER

pytestmark = pytest.mark.e2e

CASES = [f"{pin}/{variant}" for pin in ci_pins() for variant in ("plugin", "patched")]
REQUESTS, CLIENTS, NEW_TOKENS = 16, 4, 8
SYSTEM_PROMPT = [(11 * k) % 500 + 3 for k in range(64)]
ROLES = ("prefill", "decode")
_runs: dict[str, dict[str, Any]] = {}


def _say(msg: str) -> None:
    print(f"[gpu-semantics-e2e] {msg}", file=sys.stderr, flush=True)


def prompt(i: int) -> list[int]:
    """The shared system prompt, then a request of its own (40-140 tokens)."""
    return SYSTEM_PROMPT + [(7 * i + 13 * k) % 500 + 3 for k in range(40 + 25 * (i % 5))]


def _pair(pin: str, variant: str, log_dir: Path) -> PDPair:
    env = {"SGLANG_HARDEN_TESTBED_CUDASIM_TOP": "1000"}
    launcher = HARDENED_LAUNCHER
    if variant == "patched":
        tree = patched_tree(pin, log_dir / "tree")
        env.update({**patched_env(tree), SECRET_FILE_ENV: ""})
        launcher = VANILLA_LAUNCHER
    return PDPair(pin, prefill_max_total_tokens=1024, decode_max_total_tokens=1024, context_length=512,
                  profile=get_profile("paged16"), env=env, log_dir=log_dir, launcher_module=launcher, progress=True)


def _run(pin: str, variant: str, log_dir: Path) -> dict[str, Any]:
    _say(f"{pin} {variant}: starting (logs {log_dir})")
    with _pair(pin, variant, log_dir) as pair:
        warm = pair.generate(greedy_body(prompt(999), NEW_TOKENS))
        before = {role: sim_state(getattr(pair, role)) for role in ROLES}
        with concurrent.futures.ThreadPoolExecutor(CLIENTS) as clients:
            results = list(clients.map(lambda i: pair.generate(greedy_body(prompt(i), NEW_TOKENS, rid=f"gpu-{i}")),
                                       range(REQUESTS)))
        after = {role: sim_state(getattr(pair, role)) for role in ROLES}
        decisions = pair.decode.harden_decisions() if variant == "plugin" else {}
        pools = pair.wait_quiesced()
        decode_log = pair.decode.log_text()
    return {"warm": warm, "results": results, "before": before, "after": after, "decisions": decisions,
            "pools": pools, "decode_log": decode_log,
            "per_request": {role: per_request(before[role], after[role], REQUESTS) for role in ROLES}}


@pytest.fixture(scope="module", params=CASES)
def pin(request: pytest.FixtureRequest) -> str:
    """The case, ``<pin>/<variant>``: named ``pin`` so that tests/conftest.py gives each case one xdist group (one
    worker starts its pair; as ``run``'s own parameter both workers started every pair)."""
    return str(request.param)


@pytest.fixture(scope="module")
def run(pin: str, require_pin: Callable[[str], None], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    version, variant = pin.split("/")
    require_pin(version)
    result = run_once(_runs, pin, lambda: _run(version, variant, tmp_path_factory.mktemp(f"gpu-{version}-{variant}")))
    return {**result, "pin": version, "variant": variant}


def test_every_request_was_served(run: dict[str, Any]) -> None:
    for result in [run["warm"], *run["results"]]:
        assert result.prefill.ok and result.decode.ok and result.decode.output_ids, \
            (result.prefill.summary(), result.decode.summary())


def test_the_simulator_was_on_and_counts_sglang_s_own_syncs(run: dict[str, Any]) -> None:
    for role in ROLES:
        assert run["after"][role], f"{role}: no testbed_cudasim block (is the cuda_sim shim on?)"
        assert owner_rows(run["per_request"][role], "sglang"), (role, run["per_request"][role])


def test_sglang_harden_adds_no_host_sync_per_request(run: dict[str, Any]) -> None:
    for role in ROLES:
        block = run["per_request"][role]
        assert owner_rows(block, HARDEN) == [], (run["pin"], run["variant"], role, owner_rows(block, HARDEN))


def test_nothing_is_read_before_its_copy_landed(run: dict[str, Any]) -> None:
    for role in ROLES:
        assert not run["after"][role].get("poisoned_reads"), (role, run["after"][role].get("poisoned_sites"))
    if run["pin"] >= "0.5.21":
        copies = owner_rows(run["per_request"]["prefill"], "sglang", "async_copies")
        assert copies, "0.5.21+ prefill copies page indices asynchronously (the path operators run)"


def test_the_guards_ran_and_the_pools_are_whole(run: dict[str, Any]) -> None:
    copies = sum(row[-1] for row in owner_rows(run["per_request"]["decode"], HARDEN, "async_copies"))
    assert copies >= 3, ("the page table row, the canary check and the digest are copied to the host per request",
                         run["per_request"]["decode"]["async_copies"])
    if run["variant"] == "plugin":
        decisions = run["decisions"]
        assert decisions.get("canary:allow", 0) >= REQUESTS and decisions.get("checksum:allow", 0) >= REQUESTS, \
            decisions
        assert not any(key.endswith(":abort") for key in decisions), decisions
    else:
        assert "sglang-harden" in run["decode_log"] and " abort:" not in run["decode_log"]
    for role in ROLES:
        assert run["pools"][role]["full"], (role, run["pools"][role])
