"""The testbed's own pieces that need no SGLang: pins.toml, process groups, shims, scenario oracles, demo."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from sglang_harden.testbed import envs, procs
from sglang_harden.testbed.client import GenResult, PairResult, _parse
from sglang_harden.testbed.incident import (
    IncidentSetup,
    RoundResult,
    black_box,
    tenant_a_prompt,
    tenant_b_prompt,
    verdict,
)
from sglang_harden.testbed.procenv import SHIMS_DIR
from sglang_harden.tools import demo

REQUIRED_PINS = {"0.4.9.post6", "0.5.19", "0.5.20", "0.5.21", "0.5.23"}


def test_pins_file_lists_supported_pins_with_recipes() -> None:
    recipes = envs.load_pins()
    assert REQUIRED_PINS <= set(recipes)
    for pin, recipe in recipes.items():
        assert recipe.sglang == pin
        assert recipe.torch_requirement.endswith("+cpu"), "the constraint must keep CUDA torch out"
        assert any(d.startswith("transformers==") for d in recipe.deps)
        assert "mooncake" in recipe.transfer_backends
        assert recipe.incident in {"leak", "reject_and_hold"}
    assert "nixl" in recipes["0.5.23"].transfer_backends
    assert {"0.5.19", "0.5.23"} <= set(envs.ci_pins())
    assert envs.all_pins()[:2] == ["0.5.19", "0.5.23"]


def test_recipe_hash_changes_only_with_build_inputs() -> None:
    recipe = envs.load_pins()["0.5.19"]
    same = envs.PinRecipe(**{**recipe.__dict__, "shims": ("other",), "decode_flags": ()})
    changed = envs.PinRecipe(**{**recipe.__dict__, "deps": (*recipe.deps, "extra==1")})
    assert same.build_hash() == recipe.build_hash()
    assert changed.build_hash() != recipe.build_hash()


def test_select_pins() -> None:
    assert envs.select_pins([]) == envs.ci_pins()
    assert envs.select_pins(["--all"]) == envs.all_pins()
    assert envs.select_pins(["0.5.21"]) == ["0.5.21"]


def test_missing_env_error_names_the_build_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_HARDEN_HOME", str(tmp_path))
    with pytest.raises(envs.EnvError, match="scripts/setup_envs.sh 0.5.19"):
        envs.require_env("0.5.19")
    with pytest.raises(envs.EnvError, match="unknown pin"):
        envs.get_recipe("9.9.9")


def test_no_cpu_torch_wheel_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SGLANG_HARDEN_TORCH_WHEEL", raising=False)
    recipe = envs.PinRecipe(**{**envs.load_pins()["0.5.19"].__dict__, "torch_find_links": (str(tmp_path),)})
    with pytest.raises(envs.EnvError, match="CUDA build"):
        envs.find_cpu_torch_wheel(recipe)


def test_disk_check(tmp_path: Path) -> None:
    with pytest.raises(envs.EnvError, match="not enough disk"):
        envs._check_disk(tmp_path, 1e9)


def test_package_hash_tracks_sources(tmp_path: Path) -> None:
    (tmp_path / "sglang_harden").mkdir()
    (tmp_path / "pyproject.toml").write_text("x")
    (tmp_path / "sglang_harden" / "a.py").write_text("1")
    first = envs.package_sources_hash(tmp_path)
    (tmp_path / "sglang_harden" / "a.py").write_text("2")
    assert envs.package_sources_hash(tmp_path) != first


def test_spawn_and_kill_exactly_the_group(tmp_path: Path) -> None:
    script = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    proc = procs.spawn([sys.executable, "-c", script], dict(os.environ), tmp_path / "x.log")
    time.sleep(0.5)
    assert procs.group_alive(proc.pid)
    assert os.getpgid(proc.pid) == proc.pid != os.getpgid(0)
    assert proc.pid in procs.started_groups()
    assert procs.kill_groups([proc.pid], term_timeout=5) == []
    assert not procs.group_alive(proc.pid)  # the grandchild 'sleep' went with its group


def test_free_ports_are_distinct() -> None:
    ports = {procs.free_port(span=3) for _ in range(5)}
    assert len(ports) == 5


def _run_with_shims(code: str, shims: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": f"{SHIMS_DIR}{os.pathsep}{Path(__file__).resolve().parents[2]}",
        "SGLANG_HARDEN_TESTBED_SHIMS": shims,
    }
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True)


def test_stub_modules_expose_exactly_their_names() -> None:
    code = """
        from sgl_kernel import assign_req_to_token_pool_cpu
        try:
            from sgl_kernel import something_else
        except ImportError:
            print("import-error")
        try:
            assign_req_to_token_pool_cpu()
        except NotImplementedError:
            print("stub-raises")
        from sgl_kernel.kvcacheio import transfer_kv_per_layer
        from vllm._custom_ops import scaled_fp8_quant
        try:
            import vllm.model_executor
        except ImportError:
            print("no-real-vllm")
    """
    out = _run_with_shims(code, "sgl_kernel_cpu_stub,sgl_kernel_kvcacheio_stub,vllm_custom_ops_stub")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["import-error", "stub-raises", "no-real-vllm"]


def test_unknown_shim_fails_loudly() -> None:
    out = _run_with_shims("print('ran')", "no_such_shim")
    assert "unknown testbed shim" in out.stderr


def _gen(status: int, ids: list[int] | None = None, elapsed: float = 0.1, err: str = "") -> GenResult:
    body = {"error": {"message": err}} if err else {}
    return GenResult(status=status, body=body, elapsed_s=elapsed, output_ids=ids, logprobs=[-1.0] * len(ids or []))


def _round(i: int, seed: int, ids: list[int] | None, pages: int, b_status: int = 200) -> RoundResult:
    a = PairResult(_gen(200, [1]), _gen(200, [1]), room=1)
    b = PairResult(_gen(200, [0]), _gen(b_status, ids), room=2)
    return RoundResult(index=i, a_seed=seed, a_rid=f"A{i}", b_rid=f"B{i}", a=a, b=b, b_rows=300, a_rows_read_by_b=pages)


def test_oracles_on_a_leak() -> None:
    rounds = [_round(1, 1, [5, 6], 208), _round(2, 2, [7, 8], 208), _round(3, 1, [5, 6], 208)]
    bb = black_box(rounds)
    assert bb == {**bb, "repeatable": True, "depends_on_a": True, "distinct_b_outputs": 2}
    assert verdict(rounds, bb, IncidentSetup()) == "LEAK"


def test_oracles_on_reject_and_hold() -> None:
    a = PairResult(_gen(200, [1]), _gen(200, [1]), room=1)
    b = PairResult(_gen(400, err="Input length (300 tokens) exceeds"), _gen(500, elapsed=21.0), room=2)
    rounds = [RoundResult(index=1, a_seed=1, a_rid="A1", b_rid="B1", a=a, b=b)]
    bb = black_box(rounds)
    assert not bb["depends_on_a"] and bb["b_completed_rounds"] == 0
    assert verdict(rounds, bb, IncidentSetup(waiting_timeout_s=20)).startswith("rejected; decode held")


def test_prompts_are_deterministic_and_distinct() -> None:
    assert tenant_a_prompt(1, 200) == tenant_a_prompt(1, 200) != tenant_a_prompt(2, 200)
    assert len(tenant_b_prompt(300)) == 300 and min(tenant_b_prompt(300)) >= 3


def test_parse_generate_answer() -> None:
    body = {
        "text": "x",
        "output_ids": [4, 5],
        "meta_info": {"prompt_tokens": 3, "output_token_logprobs": [[-0.5, 4, None], [-0.25, 5, None]]},
    }
    res = _parse(200, body, 0.2)
    assert res.output_ids == [4, 5] and res.logprobs == [-0.5, -0.25] and res.meta["prompt_tokens"] == 3


def test_demo_table_and_variant_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = {
        "b_status": 200,
        "b_prefill_status": 200,
        "b_output_short": "1 2 3",
        "pages_of_a_read_by_b": 208,
        "verdict": "LEAK",
    }
    monkeypatch.setattr(demo, "VARIANTS", {"vanilla": lambda pin: {**fake, "pin": pin}})
    demo.add_variant(
        "hardened", lambda pin: {**fake, "b_status": 400, "pages_of_a_read_by_b": 0, "verdict": "rejected"}
    )
    report = demo.collect(["0.5.19"])
    assert set(report["pins"]["0.5.19"]) == {"vanilla", "hardened"}
    table = demo.render_table(report)
    assert "LEAK" in table and "208" in table and "hardened" in table


def test_suite_fails_when_a_started_process_outlives_it(tmp_path: Path) -> None:
    """tests/conftest.py's end-of-session check: a leftover group fails the session and is killed."""
    repo = Path(__file__).resolve().parents[2]
    (tmp_path / "conftest.py").write_text((repo / "tests" / "conftest.py").read_text())
    (tmp_path / "test_leftover.py").write_text(
        textwrap.dedent("""
        import os, sys
        from pathlib import Path
        from sglang_harden.testbed import procs

        def test_leaves_a_process_behind(tmp_path):
            proc = procs.spawn(["sleep", "60"], dict(os.environ), tmp_path / "x.log")
            Path(os.environ["LEFTOVER_PID_OUT"]).write_text(str(proc.pid))
        """)
    )
    env = {k: v for k, v in os.environ.items() if k != procs.PIDFILE_ENV}
    env.update(PYTHONPATH=str(repo), LEFTOVER_PID_OUT=str(tmp_path / "pid"))
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert out.returncode != 0, out.stdout
    assert "still alive at the end" in out.stdout
    assert not procs.group_alive(int((tmp_path / "pid").read_text()))


def test_free_ports_sit_below_the_ephemeral_range() -> None:
    low, _ = procs._ephemeral_range()
    for _ in range(20):
        port = procs.free_port(span=3)
        assert port + 3 <= low, (port, low)


def _hardened_column(**changes: object) -> dict[str, object]:
    column: dict[str, object] = {
        "b_status": 400,
        "b_output_ids": None,
        "pages_of_a_read_by_b": 0,
        "capacity_default": {"refused": True},
        "pools_full_at_quiesce": True,
        "front_door": {"decode_status": 400, "decode_elapsed_s": 0.6, "decode_generated": False},
    }
    column.update(changes)
    return column


@pytest.mark.parametrize(
    ("changes", "blocked"),
    [
        ({}, True),
        ({"b_status": 200}, False),
        ({"pages_of_a_read_by_b": 3}, False),
        ({"pools_full_at_quiesce": False}, False),
        ({"front_door": {"decode_status": 500, "decode_elapsed_s": 20.1, "decode_generated": False}}, False),
        ({"front_door": {"decode_status": 400, "decode_elapsed_s": 9.0, "decode_generated": False}}, False),
        ({"front_door": None}, False),
        ({"capacity_default": {"refused": False}}, False),
    ],
)
def test_demo_hardened_verdict_needs_every_condition(changes: dict[str, object], blocked: bool) -> None:
    report = {"pins": {"0.5.19": {"hardened": _hardened_column(**changes)}}}
    assert demo.hardened_blocked(report) is blocked
    assert demo.render_table(report)


def test_bind_failure_counts_only_for_our_own_ports() -> None:
    from sglang_harden.testbed.server import _Process

    class Proc(_Process):
        def own_ports(self) -> list[int]:
            return [45591, 23456]

    proc = Proc()
    uvicorn = "ERROR: [Errno 98] error while attempting to bind on address ('127.0.0.1', 45591): address already in use"
    assert proc._lost_a_port("starting\n" + uvicorn)
    assert not proc._lost_a_port("transport: bind 15437 failed: Address already in use; trying the next port")
    assert not proc._lost_a_port("fired up and ready to roll")


def _latewrite_shim(monkeypatch: pytest.MonkeyPatch, raw: str, trace: Path) -> Any:
    import importlib

    monkeypatch.syspath_prepend(str(SHIMS_DIR))
    monkeypatch.setenv("SGLANG_HARDEN_TESTBED_LATE_WRITE", raw)
    monkeypatch.setenv("SGLANG_HARDEN_TESTBED_KVTRACE_DIR", str(trace))
    import sglang_harden_latewrite

    return importlib.reload(sglang_harden_latewrite)


class _FakeAgent:
    def __init__(self) -> None:
        self.posted: list[object] = []

    def transfer(self, handle: object) -> str:
        self.posted.append(handle)
        return "PROC"

    def check_xfer_state(self, handle: object) -> str:
        return "DONE"


def _fake_nixl_module() -> Any:
    class NixlKVManager:
        def __init__(self) -> None:
            self.agent = _FakeAgent()

        def send_kvcache(self, peer_name: str, prefill_kv_indices: list[int], *args: object) -> object:
            handle = object()
            state = self.agent.transfer(handle)
            if state == "ERR":
                raise RuntimeError("KVSender failed to post prepped transfer")
            return handle

    return SimpleNamespace(NixlKVManager=NixlKVManager)


def _trace_events(trace: Path) -> list[dict[str, Any]]:
    import json

    return [json.loads(line) for f in sorted(trace.glob("latewrite-*.jsonl")) for line in f.read_text().splitlines()]


def test_latewrite_shim_nixl_post_times_out_and_lands_on_trigger(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    """NIXL: the KV post of a listed room reports ERR after ``timeout`` while the same handle is posted for real
    when the trigger appears; other rooms and posts outside the KV send are untouched."""
    trigger = tmp_path / "go"
    shim = _latewrite_shim(monkeypatch, f"5:42:timeout=0.1:trigger={trigger}", tmp_path)
    module = _fake_nixl_module()
    shim._patch_nixl_manager(module)
    mgr = module.NixlKVManager()
    shim._tls.room = 43
    assert mgr.send_kvcache("peer", [1, 2, 3]) is mgr.agent.posted[-1], "another room: untouched"
    shim._tls.room = 42
    mgr.agent.transfer("aux")  # the aux post of the same room: not a KV send, untouched
    assert mgr.agent.posted[-1] == "aux"
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="failed to post"):
        mgr.send_kvcache("peer", [1, 2, 3])
    assert 0.1 <= time.monotonic() - started < 1.0
    assert len(mgr.agent.posted) == 2, "the write is still pending"
    trigger.touch()
    deadline = time.monotonic() + 3
    while len(mgr.agent.posted) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)
    events = _trace_events(tmp_path)
    assert [e["event"] for e in events] == ["kv_send", "engine_timeout", "late_write"]
    late = events[2]
    assert late["backend"] == "nixl" and late["room"] == 42 and late["blocks"] == 3 and late["triggered"]
    assert late["mode"] == "timed_out" and late["status"] == 0
    assert len(mgr.agent.posted) == 3


def test_latewrite_shim_nixl_blocking_post(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    shim = _latewrite_shim(monkeypatch, "0.2:42", tmp_path)
    module = _fake_nixl_module()
    shim._patch_nixl_manager(module)
    mgr = module.NixlKVManager()
    shim._tls.room = 42
    started = time.monotonic()
    handle = mgr.send_kvcache("peer", [1, 2])
    assert time.monotonic() - started >= 0.2
    assert mgr.agent.posted == [handle]
    events = _trace_events(tmp_path)
    assert [(e["event"], e.get("mode")) for e in events] == [("kv_send", None), ("late_write", "blocking")]


def _fake_mooncake_module(sent: list[str]) -> Any:
    class MooncakeKVManager:
        session_lock = threading.Lock()
        failed_sessions: set[str] = set()
        session_failures: dict[str, int] = {}

        def _transfer_data(self, session_id: str, transfer_blocks: list[int]) -> int:
            sent.append(f"engine {len(transfer_blocks)}")
            return 0

        def send_kvcache(self, session_id: str, prefill_kv_indices: list[int], dst_kv_ptrs: list[int],
                         dst_kv_indices: list[int], executor: object) -> int:
            sent.append(f"send {len(prefill_kv_indices)}")
            return self._transfer_data(session_id, list(prefill_kv_indices))

    return SimpleNamespace(MooncakeKVManager=MooncakeKVManager)


@pytest.mark.parametrize(("version", "delayed"), [("0.4.10.post2", "send_kvcache"), ("0.5.19", "_transfer_data")])
def test_latewrite_shim_mooncake_times_out_the_kv_write_of_each_release(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, version: str, delayed: str) -> None:
    """0.4.x calls the engine from send_kvcache's executor threads (no room there), and 0.4.10 calls _transfer_data
    for the aux data on the worker thread: the whole KV send is made late there, _transfer_data from 0.5 on."""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "sglang", types.ModuleType("sglang"))
    monkeypatch.setitem(sys.modules, "sglang.version", SimpleNamespace(__version__=version))
    shim = _latewrite_shim(monkeypatch, "0.3:42:timeout=0.05", tmp_path)
    sent: list[str] = []
    module = _fake_mooncake_module(sent)
    shim._patch_manager(module)
    mgr = module.MooncakeKVManager()
    shim._tls.room = 42
    assert mgr.send_kvcache("s", [1, 2, 3], [], [7, 8, 9], None) == -1
    assert sent == ([] if delayed == "send_kvcache" else ["send 3"])  # timed out; the write itself still pending
    if delayed == "send_kvcache":
        assert mgr._transfer_data("s", [1]) == 0 and sent == ["engine 1"]  # 0.4.10's aux: untouched
    deadline = time.monotonic() + 3
    while not any(e["event"] == "late_write" for e in _trace_events(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.02)
    events = _trace_events(tmp_path)
    assert [e["event"] for e in events] == ["kv_send", "engine_timeout", "late_write"]
    assert events[0]["dst_pages"] == [7, 8, 9] and events[2]["blocks"] == 3


def test_demo_late_write_scenario_takes_a_backend(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from sglang_harden.testbed import latewrite

    seen: dict[str, Any] = {}

    def fake_report(pins: list[str], setup: Any = None, say: Any = None, **_: Any) -> dict[str, Any]:
        seen.update(pins=pins, backend=setup.backend)
        return {"scenario": "late-write", "backend": setup.backend, "ok": True,
                "pins": {p: {"hardened": {"verdict": "clean", "corrupted_requests": 0}} for p in pins}}

    monkeypatch.setattr(latewrite, "collect_report", fake_report)
    monkeypatch.setattr(envs, "require_env", lambda pin: Path(sys.executable))
    import argparse

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    assert demo.run(parser.parse_args(["--scenario", "late-write", "--backend", "nixl", "--pin", "0.5.23"])) == 0
    assert seen == {"pins": ["0.5.23"], "backend": "nixl"}
    assert "nixl" in capsys.readouterr().out
    assert demo.run(parser.parse_args(["--backend", "nixl", "--pin", "0.5.23"])) == 2  # incident: mooncake only


def test_latewrite_shim_logs_the_decode_pages_a_listed_rooms_send_targets(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    """Both backends: a KV send of a listed room logs ``kv_send`` with its ``dst_kv_indices`` (positional or
    keyword, wherever the pin's signature puts them); other rooms log nothing."""
    shim = _latewrite_shim(monkeypatch, "0:42", tmp_path)

    class NixlKVManager:
        def __init__(self) -> None:
            self.agent = _FakeAgent()

        def send_kvcache(self, peer_name: str, prefill_kv_indices: list[int], dst_kv_ptrs: list[int],
                         dst_kv_indices: list[int], dst_gpu_id: int) -> str:
            return self.agent.transfer(object())

        def send_kvcache_slice(self, peer_name: str, prefill_kv_indices: list[int],
                               dst_kv_indices: list[int]) -> str:
            return "DONE"

    class MooncakeKVManager:
        def _transfer_data(self, session_id: str, blocks: list[tuple[int, int, int]]) -> int:
            return 0

        def send_kvcache(self, session_id: str, prefill_kv_indices: list[int], dst_kv_ptrs: list[int],
                         dst_kv_indices: list[int], executor: object) -> int:
            return self._transfer_data(session_id, [(0, 0, 8)] * len(prefill_kv_indices))

    shim._patch_nixl_manager(SimpleNamespace(NixlKVManager=NixlKVManager))
    shim._patch_manager(SimpleNamespace(MooncakeKVManager=MooncakeKVManager))
    shim._tls.room = 43
    NixlKVManager().send_kvcache("peer", [1, 2], [0], [7, 8], 0)
    assert _trace_events(tmp_path) == []
    shim._tls.room = 42
    NixlKVManager().send_kvcache("peer", [1, 2], [0], [7, 8], 0)
    NixlKVManager().send_kvcache_slice("peer", [1], dst_kv_indices=[9])
    import numpy as np

    assert MooncakeKVManager().send_kvcache("session", [1, 2, 3], [0], np.array([10, 11, 12], np.int32), None) == 0
    sends = [(e["room"], e["dst_pages"]) for e in _trace_events(tmp_path) if e["event"] == "kv_send"]
    assert sends == [(42, [7, 8]), (42, [9]), (42, [10, 11, 12])]


def _wait_for(predicate: Any, seconds: float = 3.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())


def _append_jsonl(path: Path, record: dict[str, Any]) -> None:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write(json.dumps(record) + "\n")


@pytest.mark.parametrize("or_after_release", [False, True])
def test_landing_trigger_fires_when_a_victim_decodes_over_As_pages(tmp_path: Path, or_after_release: bool) -> None:
    """The late write lands in the first victim handed one of A's decode pages; a victim on other pages fires it
    only with ``or_after_release`` and only when sent after A's release time."""
    from sglang_harden.testbed.latewrite_trace import LandingTrigger, trigger_path

    trace = tmp_path / "kvtrace"
    _append_jsonl(trace / "latewrite-1.jsonl", {"event": "kv_send", "room": 42, "dst_pages": [100, 101, 102]})
    trigger = LandingTrigger(tmp_path, release_at=time.time() + 0.3, or_after_release=or_after_release)
    try:
        trigger.sent("B0")  # before A's release time
        _append_jsonl(trace / "kvtrace-1.jsonl", {"event": "first_decode", "rid": "B0", "pages": [1, 2, 3]})
        _append_jsonl(trace / "kvtrace-1.jsonl", {"event": "first_decode", "rid": "W0", "pages": [100]})
        time.sleep(0.4)
        assert trigger.fired_for is None and not trigger_path(tmp_path).exists()
        trigger.sent("B1")  # after A's release time, on other pages
        _append_jsonl(trace / "kvtrace-1.jsonl", {"event": "first_decode", "rid": "B1", "pages": [4, 5]})
        if or_after_release:
            assert _wait_for(lambda: trigger.fired_for == "B1")
            assert trigger.reason == "sent after A's release" and trigger_path(tmp_path).exists()
            return
        time.sleep(0.3)
        assert trigger.fired_for is None
        trigger.sent("B2")
        _append_jsonl(trace / "kvtrace-1.jsonl", {"event": "first_decode", "rid": "B2", "pages": [3, 101]})
        assert _wait_for(lambda: trigger.fired_for == "B2")
        assert trigger.reason == "decodes over A's pages" and trigger_path(tmp_path).exists()
    finally:
        trigger.stop()


def _late_write_run(decode_log: str, victims: dict[str, list[int]]) -> dict[str, Any]:
    from sglang_harden.testbed.client import GenResult, PairResult

    def answer() -> PairResult:
        ok = GenResult(status=200, body={}, elapsed_s=1.0, output_ids=[1, 2], logprobs=[-0.5, -0.25])
        return PairResult(prefill=ok, decode=ok, room=0)

    return {"t0": 0.0, "victims": {rid: answer() for rid in victims}, "ref": answer(),
            "pool": {"available_tokens": 340, "max_total_num_tokens": 340},
            "misowned": answer(), "decode_log": decode_log, "room_a": 42}


@pytest.mark.parametrize("handed_early", [False, True])
def test_late_write_judge_reports_what_its_verdict_rests_on(tmp_path: Path, handed_early: bool) -> None:
    """A's quarantined page count comes from decode's decision lines; a victim that decoded over one of A's pages
    before the write landed is named; a served victim the tracer did not judge is a gap, not a clean row."""
    from sglang_harden.testbed.latewrite import judge

    trace = tmp_path / "kvtrace"
    _append_jsonl(trace / "latewrite-1.jsonl", {"event": "kv_send", "room": 42, "dst_pages": [100, 101, 102]})
    _append_jsonl(trace / "latewrite-1.jsonl", {"event": "late_write", "room": 42, "t": 50.0, "status": 0})
    b0_pages = [101, 7] if handed_early else [7, 8]
    _append_jsonl(trace / "kvtrace-1.jsonl", {"event": "first_decode", "rid": "B0", "pages": b0_pages, "t": 40.0})
    _append_jsonl(trace / "kvtrace-1.jsonl", {"event": "release", "rid": "B0", "context_rows_changed": 0})
    _append_jsonl(trace / "kvtrace-1.jsonl", {"event": "first_decode", "rid": "B1", "pages": [102], "t": 60.0})
    decode_log = "\n".join([
        '[t] sglang_harden.decision {"guard": "lifecycle", "decision": "quarantine", "owner": "room:42", "pages": 2}',
        '[t] sglang_harden.decision {"guard": "lifecycle", "decision": "quarantine", "owner": "room:43", "pages": 9}',
        '[t] sglang_harden.decision {"guard": "lifecycle", "decision": "quarantine", "owner": "room:42", "pages": 1}',
        "[t] some other line",
    ])
    result = judge(_late_write_run(decode_log, {"B0": b0_pages, "B1": [102]}), trace)
    assert result["a_pages_quarantined"] == 3
    assert result["handed_a_pages_before_write_landed"] == (["B0"] if handed_early else [])
    assert result["victims"]["B1"]["pages_shared_with_a"] == 1  # after the write landed: not "handed early"
    assert result["tracer_gaps"] == ["B1"]  # served, but no release line with context_rows_changed


def test_late_write_setup_per_profile() -> None:
    from sglang_harden.testbed.latewrite import setup_for

    assert setup_for("minimal").decode_max_total_tokens == 340
    paged = setup_for("paged16", "nixl")
    assert (paged.decode_max_total_tokens, paged.backend, paged.profile) == (384, "nixl", "paged16")
    with pytest.raises(ValueError, match="no decode pool size measured for page size 64"):
        setup_for("paged64")


def test_armed_schedulers_reads_the_runtime_start_up_lines(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The testbed parses what the runtime logs (one line per armed scheduler), not a copy of its format."""
    from sglang_harden.compat.runtime import Runtime
    from sglang_harden.testbed.server import ArmedScheduler, Server

    runtime = Runtime()
    runtime.pin, runtime.family, runtime.source = "0.5.23", "sglang-0.5.19+", "plugin"
    runtime.armed = ("admission", "retire")
    with caplog.at_level("WARNING", logger="sglang_harden"):
        runtime.log_active("scheduler/decode")
    server = Server.__new__(Server)  # only its log is read
    server.log_path = tmp_path / "server.log"
    server.log_path.write_text("starting\n" + caplog.text + "\nfired up and ready to roll\n")
    assert server.armed_schedulers() == [
        ArmedScheduler("0.5.23", "decode", os.getpid(), "plugin", ("admission", "retire"))]


def test_reset_waits_for_a_leader_still_exiting_and_refuses_a_running_one(tmp_path: Path) -> None:
    """A pair restarted on fresh ports after a port clash resets each part: a leader that is still finishing
    (CI saw one a moment after its group was found gone) is waited for; one that keeps running is refused."""
    from sglang_harden.testbed.server import ServerError, _Process

    class Part(_Process):
        name, log_path = "part", tmp_path / "part.log"
        picked = 0

        def pick_ports(self) -> None:
            self.picked += 1

    exiting = Part()
    exiting.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    exiting.reset(exit_wait_s=30.0)
    assert exiting.proc is None and exiting.picked == 1

    running = Part()
    running.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(ServerError, match="part is still running"):
            running.reset(exit_wait_s=0.2)
        assert running.proc is not None and running.picked == 0
    finally:
        running.proc.kill()
        running.proc.wait(timeout=10)
