"""The incident on a real PD pair whose SGLang is a patched copy (``patches/<pin>``) with the plugin OFF.

The pin's installed ``sglang/`` is copied, ``sglang-harden patch apply`` patches the copy, and the copy goes
first on PYTHONPATH of both servers (``SGLANG_HARDEN_ACTIVATE=0``, so the plugin's entry point stays out).
The scenario's pools are deliberately too small for the context, so the backported capacity gate runs in
log mode (``SGLANG_HARDEN_CAPACITY=log``) — the request-path patches are what must stop the leak.

The patched pair runs the series' control-plane authentication with a secret file (every bootstrap request
the servers send is signed; an attacker without the secret is refused before the rounds); the patched-truncate
pair runs without one.

Per pin, one vanilla pair and one patched pair (sequentially), rounds: tenant A (200 tokens) then tenant B
(300 tokens; prefill's limit 250, decode's 394):
- patched: B gets HTTP 400 with prefill's original "exceeds the maximum allowed length" message from prefill
  AND from decode, decode answers within seconds (not its waiting timeout), no completion for B;
- normal requests are unchanged: A's greedy output ids are identical on the vanilla and the patched pair.

The vanilla pair also answers the operator tools (before it stops; one pair start fewer than a pair of their
own): ``audit`` flags its asymmetric pools, ``probe`` fails naming the probes and the evidence (oversized prompt
answered 200; B's output depends on A's traffic). The other tool cases: ``test_tools_e2e.py``,
``test_guards_e2e.py``.
"""

from __future__ import annotations

import json
import secrets
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from sglang_harden.testbed.client import PairResult, greedy_body, greedy_difference
from sglang_harden.testbed.envs import load_pins
from sglang_harden.testbed.incident import (
    COVERAGE_ALONE,
    KVTRACE_ENV,
    WAITING_TIMEOUT_ENV,
    IncidentSetup,
    RoundResult,
    assert_b_refused_at_both_doors,
    assert_table_fault_read_by_vanilla,
    front_door_round,
    read_kvtrace,
    run_round,
    tenant_a_prompt,
)
from sglang_harden.testbed.memo import run_once
from sglang_harden.testbed.patched import patched_env, patched_tree
from sglang_harden.testbed.patched_bootstrap import registration
from sglang_harden.testbed.pd_topology import PDPair
from sglang_harden.testbed.server import SECRET_FILE_ENV
from sglang_harden.testbed.tools_cli import pair_args, probe_results, run_tool
from sglang_harden.tools.patch import default_patches_dir, load_series

pytestmark = pytest.mark.e2e

# CI runs the pins it builds (0.5.19, 0.5.23); others: --pins. 0.5.10.post1 and 0.5.18: patch path only.
PINS = ["0.4.9.post6", "0.4.10.post2", "0.5.10.post1", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23"]
DIGEST_PINS = list(PINS)  # the series with the kv-digest patch (of PINS): all of them
BACKENDS = ["mooncake", "nixl"]
SETUP = IncidentSetup(waiting_timeout_s=30)
SEEDS = (100, 1, 2)
TOO_LONG = "exceeds the maximum allowed length"
PROMPT_S = 5.0
# Two greedy runs of one prompt may part at a near-tie (logprobs this close): the vanilla pair batches B's stub and
# caches other prefixes than the patched pair, and CPU kernels break such ties either way
GREEDY_TIE = 0.01
STARTUP_TIMEOUT_S = 1800.0  # server starts take many minutes on a shared 2-core machine
# Last request of the vanilla and the patched pair (it leaves decode's pool inconsistent): the test-only kvfault
# shim points one prompt page of the request in this room at a page in the allocator's free list before the
# commit (``table`` fault; sglang_harden.testbed.shims.sglang_harden_kvfault), a mis-owned page.
TABLE_ROOM = 991_000_001
# ... and before it, a KV send of exactly UNWRITTEN_LEN pages (page size 1 here: only the UNWRITTEN_LEN-token request
# below makes one) leaves out its last page and still reports success (``unwritten`` fault, prefill side): decode's
# last reserved page keeps what it held, the incident's stale page.
UNWRITTEN_LEN = 37
# ... and the request in this room gets one bit of one received KV row flipped right before decode commits its
# transfer (``flip`` fault, decode side): a transfer that delivered wrong bytes.
FLIP_ROOM = 991_000_002
FAULT_ENV = {"SGLANG_HARDEN_TESTBED_KV_FAULT": f"table:{TABLE_ROOM},unwritten:{UNWRITTEN_LEN},flip:{FLIP_ROOM}"}
_runs: dict[tuple[str, str], dict[str, Any]] = {}


def _progress(msg: str) -> None:
    print(f"[patched-incident] {msg}", file=sys.stderr, flush=True)


def _secret_file(log_dir: Path) -> Path:
    path = log_dir / "bootstrap.secret"
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return path


def _run(pin: str, variant: str, log_dir: Path, tree: Path | None) -> dict[str, Any]:
    faulty = variant in ("vanilla", "patched", "patched-nixl")
    env = {"SGLANG_HARDEN_ACTIVATE": "0", **(FAULT_ENV if faulty else {})}
    prefill_flags = ["--allow-auto-truncate"] if variant == "patched-truncate" else []
    if tree is not None:
        env.update({**patched_env(tree), "SGLANG_HARDEN_CAPACITY": "log"})
        if variant == "patched-truncate":  # coverage alone judges the short send
            env.update(COVERAGE_ALONE)
    authenticated = variant in ("patched", "patched-nixl") and _has_auth_patch(pin)
    if authenticated:  # the series' control-plane authentication, a secret of its own
        env[SECRET_FILE_ENV] = str(_secret_file(log_dir))
    elif tree is not None:  # no secret (the testbed gives one to every server unless told otherwise)
        env[SECRET_FILE_ENV] = ""
    _progress(f"{pin} {variant}: starting pair (logs {log_dir})")
    pair = PDPair(
        pin, prefill_max_total_tokens=SETUP.prefill_max_total_tokens,
        decode_max_total_tokens=SETUP.decode_max_total_tokens, context_length=SETUP.context_length,
        num_reserved_decode_tokens=SETUP.num_reserved_decode_tokens,
        env={WAITING_TIMEOUT_ENV: str(SETUP.waiting_timeout_s), **env},
        decode_env={KVTRACE_ENV: str(log_dir / "kvtrace")}, prefill_flags=prefill_flags, log_dir=log_dir,
        startup_timeout=STARTUP_TIMEOUT_S, progress=True,
        transfer_backend="nixl" if variant.endswith("-nixl") else "mooncake",
    ).start()
    rounds: list[RoundResult] = []
    try:
        attacks = _attack(pair) if variant == "patched" and authenticated else []
        for index, seed in enumerate(SEEDS):
            rounds.append(run_round(pair, index, seed, SETUP, tag=f"{variant}-"))
            b = rounds[-1].b
            _progress(f"{pin} {variant} round {index}: B prefill {b.prefill.status} decode {b.decode.status} "
                      f"in {b.decode.elapsed_s:.2f}s ({b.decode.error_message()[:80] if not b.decode.ok else 'ok'})")
        front_door = front_door_round(pair, SETUP, tag=f"{variant}-") if variant == "patched" else None
        tools = _operator_tools(pair, load_pins()[pin].incident == "leak") if variant == "vanilla" else {}
        unwritten = _unwritten_page(pair) if faulty else None
        flipped = _flipped_bit(pair) if faulty else None
        table = _mis_owned_page(pair) if faulty else None
        if variant == "vanilla":  # the control of the authenticated series: last, the forged rank stays registered
            attacks = _attack(pair)
        logs = {"prefill": pair.prefill.log_text(), "decode": pair.decode.log_text()}
    finally:
        pair.stop()
    return {"rounds": rounds, "logs": logs, "tools": tools, "attacks": attacks, "front_door": front_door,
            "table": table, "unwritten": unwritten, "flipped": flipped, **_table_evidence(log_dir / "kvtrace")}


def _has_auth_patch(pin: str) -> bool:
    """The pin's series authenticates the control plane (without it an attacker would succeed: no attack is run)."""
    return any("authenticate-control-plane" in patch.name
               for patch in load_series(pin, default_patches_dir()))


def _unwritten_page(pair: PDPair) -> PairResult:
    return pair.generate(greedy_body(tenant_a_prompt(9, UNWRITTEN_LEN), 8, rid="unwritten-page"),
                         timeout=SETUP.waiting_timeout_s + 120)


def _flipped_bit(pair: PDPair) -> PairResult:
    return pair.generate(greedy_body(tenant_a_prompt(33, 90), 8, rid="flipped-bit"), room=FLIP_ROOM,
                         timeout=SETUP.waiting_timeout_s + 120)


def _mis_owned_page(pair: PDPair) -> PairResult:
    return pair.generate(greedy_body(tenant_a_prompt(21, 120), 8, rid="table-fault"), room=TABLE_ROOM,
                         timeout=SETUP.waiting_timeout_s + 120)


def _table_evidence(trace_dir: Path) -> dict[str, Any]:
    """The fault the shim applied (so a pass is not a fault that never happened) and the table-fault request's
    first decode step as the KV tracer saw it (None: decode never ran one)."""
    faults = [json.loads(line) for path in sorted(trace_dir.glob("kvfault-*.jsonl"))
              for line in path.read_text().splitlines() if line.strip()]
    first = next((e for e in read_kvtrace(trace_dir) if e.get("event") == "first_decode"
                  and e.get("rid") == "table-fault"), None)
    return {"table_fault": [f for f in faults if f.get("event") == "table_fault"], "table_first_decode": first,
            "flips": [f for f in faults if f.get("event") == "flip"]}


def _attack(pair: PDPair) -> list[tuple[str, int]]:
    """An attacker without the secret (on the patched pair before the rounds, on vanilla after everything else):
    register itself as prefill's rank 0 (had it worked, decode would fetch KV from 127.0.0.2 and every round would
    fail), post a rejection notice for a room, read the notices and the rank table. Each (request, status)."""
    forged_rank = dict(registration(1), rank_ip="127.0.0.2")
    forged = [("PUT", "/route", json.dumps(forged_rank).encode()),
              ("PUT", "/pd_rejections", json.dumps({"room": 1, "status_code": 400, "message": "forged"}).encode()),
              ("GET", "/pd_rejections?rooms=1", b""),
              ("GET", "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0", b""),
              ("POST", "/query_dp_ranks", json.dumps({"bootstrap_rooms": [1]}).encode())]
    assert pair.prefill.bootstrap_port is not None
    out = []
    for method, target, body in forged:
        request = urllib.request.Request(f"http://127.0.0.1:{pair.prefill.bootstrap_port}{target}", data=body or None,
                                         method=method)
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                out.append((f"{method} {target}", int(answer.status)))
        except urllib.error.HTTPError as exc:
            out.append((f"{method} {target}", int(exc.code)))
    return out


def _operator_tools(pair: PDPair, leaks: bool) -> dict[str, Any]:
    """Each tool's (exit code, JSON), or what it raised (only that tool's test then fails). The probe only where
    vanilla leaks (its test asserts nothing elsewhere)."""
    _progress("vanilla: audit and probe, as an operator runs them")
    runs = {"audit": ("audit", pair.prefill.url, pair.decode.url, "--timeout", "20")}
    if leaks:
        runs["probe"] = ("probe", *pair_args(pair), "--seed", "7", "--max-requests", "40", "--time-budget", "400")
    out: dict[str, Any] = {}
    for name, args in runs.items():
        try:
            out[name] = run_tool(*args)
        except Exception as exc:  # noqa: BLE001 - re-raised by that tool's test
            out[name] = exc
    return out


def _tool(incident: Any, pin: str, name: str) -> tuple[int, dict[str, Any]]:
    found = incident(pin, "vanilla")["tools"][name]
    if isinstance(found, Exception):
        raise found
    return found


@pytest.fixture(scope="module")
def incident(require_pin: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    def make(pin: str, variant: str) -> dict[str, Any]:
        patched = variant.startswith("patched")
        tree = patched_tree(pin, tmp_path_factory.mktemp(f"tree-{pin}")) if patched else None
        return _run(pin, variant, tmp_path_factory.mktemp(f"{variant}-{pin}"), tree)

    def get(pin: str, variant: str) -> dict[str, Any]:
        require_pin(pin)
        backend = variant.rsplit("-", 1)[1] if variant.endswith("-nixl") else "mooncake"
        if backend not in load_pins()[pin].transfer_backends:
            pytest.skip(f"{backend} is not in the {pin} testbed (its recipe's transfer_backends)")
        return run_once(_runs, (pin, variant), lambda: make(pin, variant))

    return get


@pytest.mark.parametrize("pin", PINS)
def test_vanilla_pair_serves_or_holds_b(incident: Any, pin: str) -> None:
    """The admission control: on a release that leaks, vanilla decode serves B over rows of A's KV; from 0.5.20
    prefill refuses B but decode, never told, holds B's reservation until its waiting timeout."""
    for rnd in incident(pin, "vanilla")["rounds"]:
        b = rnd.b
        if load_pins()[pin].incident == "leak":
            assert b.decode.status == 200 and b.decode.output_ids and rnd.a_rows_read_by_b > 0, rnd.to_dict()
        else:
            assert b.prefill.status == 400 and b.decode.status != 200, rnd.to_dict()
            assert b.decode.elapsed_s >= 0.8 * SETUP.waiting_timeout_s, rnd.to_dict()


@pytest.mark.parametrize("pin", PINS)
def test_vanilla_control_plane_serves_the_attacker(incident: Any, pin: str) -> None:
    """The control-plane authentication's control: vanilla's bootstrap server serves the same forged requests,
    the rank registration and the route table among them."""
    attacks = dict(incident(pin, "vanilla")["attacks"])
    assert attacks and 401 not in attacks.values(), attacks
    assert attacks["PUT /route"] == 200, attacks
    assert next(status for request, status in attacks.items() if request.startswith("GET /route?")) == 200, attacks


@pytest.mark.proves("patch", "admission", control="test_vanilla_pair_serves_or_holds_b")
@pytest.mark.parametrize("pin", PINS)
def test_patched_tree_rejects_b_at_prefill_and_decode(incident: Any, pin: str) -> None:
    for rnd in incident(pin, "patched")["rounds"]:
        assert_b_refused_at_both_doors(rnd, PROMPT_S)


@pytest.mark.parametrize("pin", PINS)
def test_patched_code_runs_in_the_servers(incident: Any, pin: str) -> None:
    """The patched copy, not the venv's SGLang, is what the scheduler processes ran (plugin off)."""
    logs = incident(pin, "patched")["logs"]
    for role in ("prefill", "decode"):
        assert "KV pool too small for the configured context" in logs[role], role
    assert "pd_rejections: prefill" in logs["decode"]


@pytest.mark.proves("patch", "bootstrap_auth", control="test_vanilla_control_plane_serves_the_attacker")
@pytest.mark.parametrize("pin", PINS)
def test_patched_control_plane_refuses_an_attacker(incident: Any, pin: str) -> None:
    """With a secret file, the patched bootstrap server refuses every request of a caller without the secret
    (prefill's rank table stayed intact: the rounds after the attack pass, test_normal_requests_unchanged), and
    says so in its log, without the token. Without one (patched-truncate), both sides warn once per process."""
    if not _has_auth_patch(pin):
        pytest.skip(f"the {pin} series has no control-plane authentication patch (not a guard claimed for it)")
    run = incident(pin, "patched")
    assert run["attacks"] and all(status == 401 for _, status in run["attacks"]), run["attacks"]
    for role in ("prefill", "decode"):
        assert "pd_auth: PD control plane authenticated (enforce mode, 1 secret(s))" in run["logs"][role], role
    assert run["logs"]["prefill"].count("pd_auth: refused ") >= len(run["attacks"])
    assert "sgh1." not in run["logs"]["prefill"]
    unauthenticated = incident(pin, "patched-truncate")["logs"]
    for role in ("prefill", "decode"):
        assert "pd_auth: the PD control plane is UNAUTHENTICATED" in unauthenticated[role], role


@pytest.mark.parametrize("pin", PINS)
def test_patched_side_channels_sign_what_the_pair_sends(incident: Any, pin: str) -> None:
    """With the secret, the patched pair's rank ports verify every ZMQ message and its peer sockets sign them: the
    rounds pass (the tests above) and no message of the pair itself was dropped or ended a listener. The attacker's
    side: tests/unit/test_patched_side_channels.py (SGLang's listener), the side-channel e2e tests."""
    if not any("authenticate-side-channels" in p.name for p in load_series(pin, default_patches_dir())):
        pytest.skip(f"the {pin} series has no side-channel patch")
    logs = incident(pin, "patched")["logs"]
    for role in ("prefill", "decode"):
        assert f"pd_side_channels: {role} mooncake rank port" in logs[role], role
        assert "ZMQ auth enforce, wire rules enforce" in logs[role], role
        assert "side-channel message(s) on" not in logs[role], role
        assert "side-channel listener" not in logs[role], role


@pytest.mark.parametrize("pin", PINS)
def test_normal_requests_unchanged(incident: Any, pin: str) -> None:
    """A, the normal tenant, reads only its own KV on the patched pair (the tracer) and gets vanilla's greedy
    answer (up to a near-tie, GREEDY_TIE)."""
    vanilla, patched = incident(pin, "vanilla")["rounds"], incident(pin, "patched")["rounds"]
    assert len(vanilla) == len(patched) == len(SEEDS)
    for v, p in zip(vanilla, patched, strict=True):
        assert v.a.decode.ok and p.a.decode.ok, (v.a.decode.summary(), p.a.decode.summary())
        assert p.a_foreign_rows == 0, p.to_dict()
        assert greedy_difference(v.a.decode, p.a.decode, GREEDY_TIE) is None, (
            greedy_difference(v.a.decode, p.a.decode, GREEDY_TIE), v.a.decode.top_logprobs, p.a.decode.top_logprobs)
        assert len(p.a.decode.output_ids or []) == SETUP.new_tokens


@pytest.mark.proves("patch", "abort_notify",
                    control="tests/e2e/test_paged_profile_e2e.py::test_vanilla_decode_holds_a_front_door_refusal")
@pytest.mark.parametrize("pin", PINS)
def test_patched_tokenizer_refusal_reaches_decode(incident: Any, pin: str) -> None:
    """Prefill's tokenizer refuses a prompt longer than the context before any scheduler sees it. The series posts
    that refusal from the tokenizer (it serves the bootstrap server in the same process), so decode, holding a
    reservation for the room, answers 400 with prefill's message within the prompt bound instead of waiting for
    its timeout (20 s here), and never generates."""
    door = incident(pin, "patched")["front_door"]
    assert door["prefill"]["status"] == 400, door
    assert door["decode_status"] == 400, door
    assert "context length" in (door["decode_error"] or ""), door
    assert door["decode_elapsed_s"] < PROMPT_S, door
    assert not door["decode_generated"], door


@pytest.mark.proves("patch", "coverage", control="tests/e2e/test_guards_e2e.py::test_vanilla_serves_a_short_send")
@pytest.mark.parametrize("pin", PINS)
def test_patched_coverage_refuses_a_short_transfer(incident: Any, pin: str) -> None:
    """Prefill with --allow-auto-truncate serves B truncated to its limit (no rejection, so the doors and the
    notice do not fire) and sends KV for 250 tokens; decode reserved 300. The coverage check must refuse it."""
    for rnd in incident(pin, "patched-truncate")["rounds"]:
        b = rnd.b
        assert b.decode.status == 500, b.decode.summary()
        assert "KV coverage mismatch" in b.decode.error_message(), b.decode.error_message()
        assert f"decode reserved {SETUP.b_len} tokens" in b.decode.error_message()
        assert not b.decode.output_ids
        assert rnd.a_rows_read_by_b == 0
        assert rnd.a.decode.ok


@pytest.mark.parametrize("pin", PINS)
def test_audit_flags_asymmetric_pools(incident: Any, pin: str) -> None:
    code, data = _tool(incident, pin, "audit")
    assert code == 1, data
    codes = {f["code"] for f in data["findings"]}
    assert {"pool_below_context", "prefill_limit_below_decode"} <= codes
    prefill, decode = data["nodes"]
    assert (prefill["role"], decode["role"]) == ("prefill", "decode")
    assert prefill["max_req_input_len"] == 250 and decode["max_req_input_len"] == 394
    assert prefill["context_length"] == 512 and prefill["pool_tokens"] == 256


@pytest.mark.parametrize("pin", PINS)
def test_probe_fails_on_vanilla_leaking_pair(incident: Any, pin: str) -> None:
    if load_pins()[pin].incident != "leak":
        pytest.skip(f"vanilla {pin} refuses B at prefill (0.5.20+), so its pair does not leak here and probe passes "
                    "(measured on 0.5.22); the leaking vanilla pairs are 0.5.10.post1's, 0.5.18's and 0.5.19's")
    code, data = _tool(incident, pin, "probe")
    assert code == 1, data
    probes = probe_results(data)
    assert probes["determinism"]["verdict"] == "pass"
    oversize = probes["oversize"]
    assert oversize["verdict"] == "FAIL"
    assert any(e.startswith("250 tokens") and "HTTP 200" in e for e in oversize["evidence"]), oversize
    cross = probes["cross_tenant"]
    assert cross["verdict"] == "FAIL", cross
    assert any("different greedy outputs" in e or "4-gram" in e for e in cross["evidence"])
    assert probes["echo_canary"]["verdict"] == "not applicable"  # a tiny random model repeats nothing


def _patched_variant(backend: str) -> str:
    return "patched" if backend == "mooncake" else f"patched-{backend}"


@pytest.mark.proves("patch", "page_tags", control="self")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pin", PINS)
def test_patched_page_tags_refuse_a_mis_owned_page(incident: Any, pin: str, backend: str) -> None:
    """SGLang's own page table points one prompt page of the request at a page in the allocator's free list, after
    the transfer wrote the right one. Vanilla decodes over it (the KV tracer sees rows another request left
    there); the patched decode's page-tag check finds a page the request does not own and aborts it with 500
    before the first decode step, over Mooncake and NIXL (the check sits at decode's commit, the ledger learns
    the pages where the prealloc queue hands them to any backend)."""
    vanilla, patched = incident(pin, "vanilla"), incident(pin, _patched_variant(backend))
    assert_table_fault_read_by_vanilla(vanilla, patched)
    p = patched["table"].decode
    assert p.status == 500 and not p.output_ids, p.summary()
    assert "page ownership check failed" in p.error_message() and "owned by None" in p.error_message(), p.summary()
    assert patched["table_first_decode"] is None, patched["table_first_decode"]
    assert "sglang-harden page_tags: ledger over" in patched["logs"]["decode"]
    assert "sglang-harden page_tags abort: rid=table-fault" in patched["logs"]["decode"]


@pytest.mark.proves("patch", "canary", control="self")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pin", PINS)
def test_patched_canary_refuses_an_unwritten_page(incident: Any, pin: str, backend: str) -> None:
    """Prefill's send leaves out the request's last page and reports success (so the coverage count and the page
    tags are satisfied). Vanilla decodes over the page's old content; the patched decode's canary finds the page
    still stamped and aborts the request with 500 before its first decode step."""
    vanilla, patched = incident(pin, "vanilla")["unwritten"], incident(pin, _patched_variant(backend))
    assert vanilla.decode.status == 200 and vanilla.decode.output_ids, vanilla.decode.summary()
    p = patched["unwritten"].decode
    assert p.status == 500 and not p.output_ids, p.summary()
    assert "canary check failed" in p.error_message() and "never written" in p.error_message(), p.summary()
    assert "sglang-harden canary abort: rid=unwritten-page" in patched["logs"]["decode"]


@pytest.mark.proves("patch", "checksum", control="self")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pin", PINS)
def test_patched_digest_refuses_a_flipped_bit(incident: Any, pin: str, backend: str) -> None:
    """One bit of one received KV row is flipped right before decode commits (every page written, the count and
    the owners right). Vanilla decodes over the wrong byte; the patched decode's digest of its rows differs from the
    one prefill posted for the rows it sent, and the request gets 500 before its first decode step."""
    if pin not in DIGEST_PINS:
        pytest.skip(f"the {pin} series has no kv-digest patch (0.5.19+)")
    vanilla, patched = incident(pin, "vanilla"), incident(pin, _patched_variant(backend))
    assert vanilla["flipped"].decode.status == 200 and vanilla["flipped"].decode.output_ids, vanilla["flipped"].decode
    assert [f["rid"] for f in vanilla["flips"]] == ["flipped-bit"], vanilla["flips"]  # the fault was applied
    assert [f["rid"] for f in patched["flips"]] == ["flipped-bit"], patched["flips"]
    p = patched["flipped"].decode
    assert p.status == 500 and not p.output_ids, p.summary()
    assert "KV checksum check failed" in p.error_message() and "KV digest mismatch" in p.error_message(), p.summary()
    assert "sglang-harden checksum abort: rid=flipped-bit" in patched["logs"]["decode"]
    clean = [r.a.decode for r in patched["rounds"]]
    assert all(a.ok for a in clean), [a.summary() for a in clean]  # every clean transfer verified and served
    assert "sglang-harden checksum skip" not in patched["logs"]["decode"], "a clean transfer was not compared"


@pytest.mark.proves("patch", "admission", control="test_vanilla_pair_serves_or_holds_b")
@pytest.mark.parametrize("pin", PINS)
def test_patched_nixl_pair_refuses_b_and_serves_a(incident: Any, pin: str) -> None:
    """The same series over NIXL: every B refused by prefill and decode, A answered exactly as by vanilla (Mooncake)
    — the page ledger's bookkeeping lets every clean request through."""
    vanilla, nixl = incident(pin, "vanilla")["rounds"], incident(pin, "patched-nixl")["rounds"]
    for v, n in zip(vanilla, nixl, strict=True):
        assert_b_refused_at_both_doors(n, PROMPT_S)
        assert n.a.decode.ok and n.a.decode.output_ids == v.a.decode.output_ids, (n.a.decode.summary(), v.index)
