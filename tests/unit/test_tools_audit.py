"""audit against local fakes: sizing findings, the incident's precondition, guards, and hostile nodes."""

from __future__ import annotations

import json
import time
from contextlib import ExitStack

import pytest
from fake_sglang import FakeNode, bytes_route, drip, endless, free_port, json_route, serve, slow

from sglang_harden.cli import main
from sglang_harden.tools.audit import parse_guard_counters

GUARDED = {"admission": {"allow": 3, "reject": 1}, "coverage": {"allow": 2}}


def run_audit(
    capsys: pytest.CaptureFixture[str], *urls: str, extra: tuple[str, ...] = (), timeout: float = 15
) -> tuple[int, dict]:
    """``audit --json``; the per-node timeout is long unless the test is about it (a loaded CI host has taken
    over a second to answer from a local fake)."""
    code = main(["audit", *urls, "--json", "--timeout", str(timeout), *extra])
    out = capsys.readouterr().out
    return code, json.loads(out)


def test_asymmetric_pools_are_flagged(capsys: pytest.CaptureFixture[str]) -> None:
    prefill = FakeNode(role="prefill", context_length=512, pool_tokens=256, guards=GUARDED)
    decode = FakeNode(role="decode", context_length=512, pool_tokens=400, max_req_input_len=394, guards=GUARDED)
    with serve(prefill.routes()) as p, serve(decode.routes()) as d:
        code, data = run_audit(capsys, p, d)
    assert code == 1
    codes = {f["code"] for f in data["findings"]}
    assert codes == {"pool_below_context", "prefill_limit_below_decode"}
    assert data["nodes"][0]["max_req_input_len"] == 250
    assert data["nodes"][0]["guards"]["admission"] == {"allow": 3.0, "reject": 1.0}


def test_symmetric_guarded_pair_passes(capsys: pytest.CaptureFixture[str]) -> None:
    prefill = FakeNode(role="prefill", pool_tokens=600, guards=GUARDED)
    decode = FakeNode(role="decode", pool_tokens=600, guards=GUARDED)
    with serve(prefill.routes()) as p, serve(decode.routes()) as d:
        code, data = run_audit(capsys, p, d)
    assert (code, data["findings"]) == (0, [])


def test_missing_guards_and_metrics(capsys: pytest.CaptureFixture[str]) -> None:
    bare = FakeNode(role="prefill", pool_tokens=600)
    no_metrics = FakeNode(role="decode", pool_tokens=600, metrics=False)
    with serve(bare.routes()) as a, serve(no_metrics.routes()) as b:
        code, data = run_audit(capsys, a, b)
    assert code == 1
    messages = [f["message"] for f in data["findings"] if f["code"] == "guards_missing"]
    assert len(messages) == 2
    assert any("not active" in m for m in messages) and any("/metrics" in m for m in messages)


def test_fallback_to_get_server_info(capsys: pytest.CaptureFixture[str]) -> None:
    node = FakeNode(pool_tokens=600, guards=GUARDED)
    routes = node.routes()
    routes[("GET", "/get_server_info")] = routes.pop(("GET", "/server_info"))
    with serve(routes) as url:
        code, data = run_audit(capsys, url)
    assert code == 0 and data["nodes"][0]["context_length"] == 512


HOSTILE = {
    "bad json": {("GET", "/server_info"): bytes_route(b"{oops")},
    "json list": {("GET", "/server_info"): json_route([1, 2, 3])},
    "empty object": {("GET", "/server_info"): json_route({})},
    "server error": {("GET", "/server_info"): json_route({"detail": "boom"}, status=500)},
    "slow": {("GET", "/server_info"): slow(10, {"context_length": 1})},
    "drip": {("GET", "/server_info"): drip(0.05, 10)},
    "huge": {("GET", "/server_info"): endless()},
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_node_is_reported_and_others_still_audited(kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    good = FakeNode(role="prefill", pool_tokens=600, guards=GUARDED)
    with serve(good.routes()) as ok_url, serve(HOSTILE[kind]) as bad_url:
        start = time.monotonic()
        code, data = run_audit(capsys, ok_url, bad_url, extra=("--max-bytes", "100000"), timeout=3)
        elapsed = time.monotonic() - start
    assert code == 2
    good_node, bad_node = data["nodes"]
    assert good_node["error"] is None and good_node["context_length"] == 512
    assert bad_node["error"] and bad_node["url"] == bad_url
    assert elapsed < 8  # the slow node (10 s) is cut off at the 3 s timeout


def test_wrong_types_become_warnings_not_crashes(capsys: pytest.CaptureFixture[str]) -> None:
    info = {
        "disaggregation_mode": ["x"],
        "context_length": "abc",
        "max_total_num_tokens": [1],
        "max_req_input_len": 100,
        "internal_states": "nope",
    }
    routes = {
        ("GET", "/server_info"): json_route(info),
        ("GET", "/v1/models"): json_route({"data": "x"}),
        ("GET", "/metrics"): bytes_route(b'garbage {{{\nsglang_harden_guard_decisions_total{guard="x"} nan?\n'),
    }
    with serve(routes) as url:
        code, data = run_audit(capsys, url)
    node = data["nodes"][0]
    assert node["error"] is None and node["max_req_input_len"] == 100
    assert any("context_length" in w for w in node["warnings"])
    assert code == 1  # no guard samples


def test_unreachable_node_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["audit", f"http://127.0.0.1:{free_port()}", "--timeout", "1"])
    out = capsys.readouterr().out
    assert code == 2 and "connection refused" in out and "Traceback" not in out


def test_parse_guard_counters_sums_processes() -> None:
    text = (
        'sglang_harden_guard_decisions_total{guard="admission",decision="reject"} 2.0\n'
        'sglang_harden_guard_decisions_total{decision="reject",guard="admission",pid="7"} 1\n'
        'sglang_harden_guard_decisions_created{guard="admission",decision="reject"} 1.7e9\n'
        "not a metric line\n"
    )
    assert parse_guard_counters(text) == {"admission": {"reject": 3.0}}


def test_many_nodes_in_parallel_bounded(capsys: pytest.CaptureFixture[str]) -> None:
    with ExitStack() as stack:
        urls = [stack.enter_context(serve({("GET", "/server_info"): slow(8)})) for _ in range(4)]
        start = time.monotonic()
        code, data = run_audit(capsys, *urls, timeout=1)
        assert time.monotonic() - start < 5  # in parallel: one timeout, not four, and not the 8 s answer
    assert code == 2 and all(n["error"] for n in data["nodes"])


def test_ignore_a_finding_code(capsys: pytest.CaptureFixture[str]) -> None:
    node = FakeNode(role="prefill", pool_tokens=600)
    with serve(node.routes()) as url:
        code, data = run_audit(capsys, url, extra=("--ignore", "guards_missing"))
    assert code == 0 and [f["code"] for f in data["findings"]] == ["guards_missing"]


def test_guards_from_server_info_report(capsys: pytest.CaptureFixture[str]) -> None:
    node = FakeNode(role="prefill", pool_tokens=600, metrics=False)
    info = node.server_info()
    info["internal_states"][0]["sglang_harden"] = {
        "guards": ["admission", "retire"],
        "decisions": {"admission:reject": 2, "bogus": "x"},
    }
    routes = node.routes()
    routes[("GET", "/server_info")] = json_route(info)
    with serve(routes) as url:
        code, data = run_audit(capsys, url)
    assert code == 0, data
    assert data["nodes"][0]["armed_guards"] == ["admission", "retire"]
    assert data["nodes"][0]["guards"] == {"admission": {"reject": 2}}


@pytest.mark.parametrize("auth,flagged", [("unauthenticated", True), ("log", True), ("enforce", False)])
def test_unauthenticated_control_plane_is_a_finding(capsys: pytest.CaptureFixture[str], auth: str,
                                                    flagged: bool) -> None:
    node = FakeNode(role="decode", pool_tokens=600, metrics=False)
    info = node.server_info()
    info["internal_states"][0]["sglang_harden"] = {"guards": ["admission"], "control_plane_auth": auth}
    routes = node.routes()
    routes[("GET", "/server_info")] = json_route(info)
    with serve(routes) as url:
        code, data = run_audit(capsys, url)
    assert data["nodes"][0]["control_plane_auth"] == auth
    codes = [f["code"] for f in data["findings"]]
    assert codes == (["control_plane_unauthenticated"] if flagged else []), data
    assert code == (1 if flagged else 0)


@pytest.mark.parametrize("auth,flagged", [("unauthenticated", True), ("log", True), ("off", True),
                                          ("enforce", False), ("enforce (not signing)", False)])
def test_unauthenticated_side_channels_are_a_finding(capsys: pytest.CaptureFixture[str], auth: str,
                                                     flagged: bool) -> None:
    node = FakeNode(role="prefill", pool_tokens=600, metrics=False)
    info = node.server_info()
    info["internal_states"][0]["sglang_harden"] = {"guards": ["admission"], "control_plane_auth": "enforce",
                                                   "side_channel_auth": auth}
    routes = node.routes()
    routes[("GET", "/server_info")] = json_route(info)
    with serve(routes) as url:
        code, data = run_audit(capsys, url)
    assert data["nodes"][0]["side_channel_auth"] == auth
    codes = [f["code"] for f in data["findings"]]
    assert codes == (["side_channels_unauthenticated"] if flagged else []), data
    assert code == (1 if flagged else 0)
