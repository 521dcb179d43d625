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
    hooks = json.loads((tmp_path / "hooks.json").read_text())
    assert hooks["steps"] and all(step["ok"] for step in hooks["steps"].values()), hooks
    assert "no host sync by sglang-harden under the CUDA simulator" in summary, summary
    assert {p.name for p in tmp_path.iterdir()} >= {"env.txt", "pytest.log", "junit.xml", "bench.json", "hooks.json"}


def test_gpu_check_refuses_unknown_arguments() -> None:
    done = subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh"), "--gpu-please"], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 2 and "usage" in done.stderr


def test_bench_guards_defaults_and_variant_subsets() -> None:
    from sglang_harden.config import GUARDS

    bench = _script("bench_guards")
    args = bench.parse_args([])
    assert (args.pin, args.backend, args.profile, args.rounds) == ("0.5.23", "mooncake", "paged16", 12)
    assert args.variants == ["all", *GUARDS], "vanilla is the baseline, not a variant"
    assert args.resamples >= 2000 and args.resolution == 0.01
    args = bench.parse_args(["--variants", "vanilla,all,lifecycle,all", "--backend", "nixl", "--pin", "0.5.19"])
    assert (args.variants, args.backend, args.pin) == (["all", "lifecycle"], "nixl", "0.5.19")
    for bad in (["--variants", "all,nosuchguard"], ["--variants", "vanilla"], ["--rounds", "1"],
                ["--min-prompt", "400", "--max-prompt", "300"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_bench_guards_variant_environments() -> None:
    from sglang_harden.config import GUARDS, load_config
    from sglang_harden.testbed import guardbench
    from sglang_harden.testbed.server import HARDENED_LAUNCHER, VANILLA_LAUNCHER

    vanilla = guardbench.variant("vanilla")
    assert (vanilla.launcher, vanilla.env, vanilla.expected_guards) == (
        VANILLA_LAUNCHER, {"SGLANG_HARDEN_ACTIVATE": "0"}, frozenset())
    every = guardbench.variant("all")
    assert every.launcher == HARDENED_LAUNCHER and every.env == {"SGLANG_HARDEN_ACTIVATE": "1"}
    assert load_config(every.env).active_guards() == list(GUARDS)
    for guard in GUARDS:
        alone = guardbench.variant(guard)
        needed = {guard, *guardbench.NEEDS.get(guard, ())}
        assert alone.launcher == HARDENED_LAUNCHER and alone.expected_guards == needed
        config = load_config(alone.env)
        assert set(config.active_guards()) == needed, guard
        assert config.capacity.value == "off" and alone.env[f"SGLANG_HARDEN_{guard.upper()}"] == "enforce"
    assert load_config(guardbench.variant("capacity").env).capacity.value == "enforce"
    assert load_config(guardbench.variant("none").env).active_guards() == []
    assert guardbench.variant("aa").launcher == VANILLA_LAUNCHER
    with pytest.raises(ValueError, match="unknown variant"):
        guardbench.variant("checksums")


def test_bench_guards_armed_check() -> None:
    from sglang_harden.testbed import guardbench

    guardbench.check_armed(guardbench.variant("lifecycle"), {"prefill": ["lifecycle"], "decode": ["lifecycle"]})
    guardbench.check_armed(guardbench.variant("all"), {"prefill": ["anything"], "decode": []})
    with pytest.raises(RuntimeError, match="expected guards"):
        guardbench.check_armed(guardbench.variant("lifecycle"), {"prefill": ["lifecycle", "canary"], "decode": []})
    with pytest.raises(RuntimeError, match="expected guards"):
        guardbench.check_armed(guardbench.variant("vanilla"), {"prefill": ["admission"], "decode": []})


def test_bench_guards_rounds_alternate_and_prompts_repeat_per_seed() -> None:
    from sglang_harden.testbed import guardbench

    bench = _script("bench_guards")
    steps = guardbench.slice_order("a", "b", 3)
    assert steps == [("a", "b"), ("b", "a"), ("b", "a"), ("a", "b"), ("a", "b"), ("b", "a")]
    workload = guardbench.Workload(requests=6, min_prompt=100, max_prompt=300)
    prompts = workload.prompts(5)
    assert prompts == workload.prompts(5) and prompts != workload.prompts(6)
    assert len(prompts) == 6 and len({tuple(p) for p in prompts}) == 6
    assert all(100 <= len(p) <= 300 for p in prompts)
    seeds = {bench.round_seed(block, r) for block in range(1, 12) for r in range(-1, 40)}
    assert len(seeds) == 11 * 41, "every round of the run gets new prompts"


def _share(tok_per_s: float, p50: float) -> dict[str, float]:
    """A pair's share of a round: 4 s measured, 8 CPU seconds itself, 0.1 s idle pair, 2 s elsewhere."""
    return {"tok_per_s": tok_per_s, "req_per_s": tok_per_s / 16, "p50_s": p50, "wall_s": 4.0,
            "measured_cpu_s": 8.0, "idle_cpu_s": 0.1, "machine_cpu_s": 10.1}


def test_bench_guards_summary_and_table() -> None:
    bench = _script("bench_guards")
    args = bench.parse_args(["--variants", "all"])
    rounds = [{"first": "vanilla" if r % 2 == 0 else "all", "vanilla": _share(100.0 + r, 0.2),
               "variant": _share((100.0 + r) * (0.98 if r % 2 else 1.0), 0.21)} for r in range(12)]
    summary = bench.summarize(args, rounds)
    tput = summary["tok_per_s"]
    assert tput["rounds"] == 12 and tput["mean"] == pytest.approx(0.99, abs=1e-4)
    assert tput["ci_low"] < 0.99 < tput["ci_high"] and len(tput["per_round"]) == 12
    assert (tput["mean_vanilla_first"], tput["mean_variant_first"]) == (1.0, 0.98)
    assert summary["p50_s"]["mean"] == pytest.approx(1.05)
    assert summary["verdict"]["text"].startswith("unresolved") and summary["verdict"]["ci_includes_1"] is False
    assert summary["rounds_for_resolution"] == 5  # stdev 0.0104: (1.96 * 0.0104 / 0.01) ** 2 = 4.2, rounded up
    assert (summary["other_load_cores"], summary["idle_pair_cpu_share"]) == (0.5, 0.0125)
    report = {"pin": "0.5.23", "backend": "mooncake", "profile": "paged16", "resamples": 2000, "seed": 0,
              "command": "python3 scripts/bench_guards.py --variants all",
              "workload": {"requests": 24, "new_tokens": 16, "clients": 4},
              "variants": [{"variant": "all", "runtime_s": 100.0, "summary": summary},
                           {"variant": "canary", "error": "no start"}]}
    table = bench.markdown(report)
    assert "Command: `python3 scripts/bench_guards.py --variants all`" in table
    assert "| all | 12 | 0.9900 |" in table and "| canary | - |" in table
