"""The PD-pair benchmark scripts' own arithmetic (their server runs are not tests: see scripts/)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
PREFILL_FREE = "prefill sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.free#lifecycle"
DECODE_LOOP = "decode sglang.srt.disaggregation.decode.DecodeTransferQueue.pop_transferred#lifecycle"


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["bench_ledger_pd", "bench_digest_pd"])
def test_pd_benchmarks_share_one_command_line(name: str) -> None:
    args = _script(name).parse_args(["--pin", "0.5.23", "--backend", "nixl", "--passes", "2",
                                     "--server-flag=--sleep-on-idle", "--json"])
    assert (args.pin, args.backend, args.passes, args.server_flags, args.json) == (
        "0.5.23", "nixl", 2, ["--sleep-on-idle"], True)
    assert (args.requests, args.warmup, args.prompt_tokens) == (30, 3, 400)


def test_ledger_pd_report_splits_transfer_hooks_from_loop_hooks() -> None:
    bench = _script("bench_ledger_pd")
    args = bench.parse_args([])
    times = {"vanilla": [0.9, 1.0, 1.1], "hardened": [0.95, 1.0, 1.2]}
    calls = Counter({PREFILL_FREE: 3, DECODE_LOOP: 3000})
    micros = Counter({PREFILL_FREE: 3000.0, DECODE_LOOP: 9000.0})  # 1 ms and 3 ms per request
    out = bench.report((times, (calls, micros)), args)
    assert out["hook_us_per_request"] == 4000.0 and out["transfer_hook_us_per_request"] == 1000.0
    assert out["ratio_in_server"] == round(1.0 / (1.0 - 0.004), 4)
    assert out["ratio_in_server_transfer"] == round(1.0 / (1.0 - 0.001), 4)
    assert out["hook_per_request"][DECODE_LOOP] == {"calls": 1000.0, "us": 3000.0}
    assert list(out["hook_per_request"]) == [DECODE_LOOP, PREFILL_FREE], "most expensive first"


def test_digest_pd_report_uses_the_digest_time_per_request() -> None:
    bench = _script("bench_digest_pd")
    args = bench.parse_args([])
    times = {"vanilla": [1.0], "no_digest": [1.0], "hardened": [1.0]}
    in_server = [{"publish": {"mean_us": 300.0, "count": 2}, "verify": {"mean_us": 700.0, "count": 2}}]
    out = bench.report((times, in_server), args)
    assert out["pin"] == "0.5.19" and out["median_s"] == {"vanilla": 1.0, "no_digest": 1.0, "hardened": 1.0}
    assert out["digest_us_per_request"] == 1000.0 and out["ratio_in_server"] == round(1.0 / 0.999, 4)


def test_gpu_check_dry_run_on_the_cpu(tmp_path: Path) -> None:
    """``scripts/gpu_check.sh --cpu-dry-run``: the GPU acceptance script's steps run on the CPU (CI has no GPU),
    say that their figures are CPU ones, and write the files a GPU run writes."""
    from sglang_harden.testbed.envs import ci_pins, venv_python

    python = venv_python(ci_pins()[-1])
    if not Path(python).exists():
        pytest.skip(f"no pin venv with torch at {python} (scripts/setup_envs.sh builds it)")
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": str(python)}
    done = subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh"), "--cpu-dry-run"], env=env, capture_output=True,
                          text=True, timeout=300)
    summary = (tmp_path / "summary.txt").read_text()
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert "dry run on the CPU (no GPU figures)" in summary and "status=0" in summary, summary
    assert json.loads((tmp_path / "bench.json").read_text()), "the benchmark wrote its report"
    assert {p.name for p in tmp_path.iterdir()} >= {"env.txt", "pytest.log", "junit.xml", "bench.json"}


def test_gpu_check_refuses_unknown_arguments() -> None:
    done = subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh"), "--gpu-please"], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 2 and "usage" in done.stderr
