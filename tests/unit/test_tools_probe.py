"""probe against local fakes: a leaking node fails naming the probe and the evidence; a refusing one passes."""

from __future__ import annotations

import json

import pytest
from fake_sglang import FakeNode, bytes_route, free_port, json_route, serve, slow

from sglang_harden.cli import main
from sglang_harden.tools.probe import check_loopback


def run_probe(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    code = main(["probe", *args, "--json", "--timeout", "5", "--seed", "1"])
    captured = capsys.readouterr()
    return code, json.loads(captured.out)


def verdicts(data: dict) -> dict[str, str]:
    return {r["probe"]: r["verdict"] for r in data["results"]}


def test_leaky_node_fails_oversize_and_cross_tenant(capsys: pytest.CaptureFixture[str]) -> None:
    node = FakeNode(pool_tokens=256, leaky=True)
    with serve(node.routes()) as url:
        code, data = run_probe(capsys, url, "--api", "native")
    assert code == 1
    v = verdicts(data)
    assert v["oversize"] == "FAIL" and v["cross_tenant"] == "FAIL" and v["determinism"] == "pass"
    assert v["echo_canary"] == "not applicable"
    oversize = next(r for r in data["results"] if r["probe"] == "oversize")
    assert any(e.startswith("250 tokens") and "HTTP 200" in e for e in oversize["evidence"])
    cross = next(r for r in data["results"] if r["probe"] == "cross_tenant")
    assert any("different greedy outputs" in e or "4-gram" in e for e in cross["evidence"])


def test_refusing_node_passes(capsys: pytest.CaptureFixture[str]) -> None:
    node = FakeNode(pool_tokens=256, echo=True)
    with serve(node.routes()) as url:
        code, data = run_probe(capsys, url)
    assert code == 0, data
    assert set(verdicts(data).values()) == {"pass"}
    assert data["requests"] <= 60


def test_plain_text_names_failing_probe(capsys: pytest.CaptureFixture[str]) -> None:
    node = FakeNode(pool_tokens=256, leaky=True)
    with serve(node.routes()) as url:
        code = main(["probe", url, "--seed", "2", "--probes", "oversize"])
    captured = capsys.readouterr()
    assert code == 1
    assert "oversize" in captured.out and "FAIL" in captured.out and "HTTP 200" in captured.out
    assert "oversize" in captured.err  # progress on stderr


def test_direct_pair_leak_is_seen_through_decode(capsys: pytest.CaptureFixture[str]) -> None:
    prefill = FakeNode(role="prefill", pool_tokens=256)  # refuses > 250
    decode = FakeNode(role="decode", pool_tokens=400, max_req_input_len=394, leaky=True)
    with serve(prefill.routes()) as p, serve(decode.routes()) as d:
        code, data = run_probe(
            capsys, "--prefill", p, "--decode", d, "--bootstrap-port", "1", "--probes", "oversize,cross_tenant"
        )
    assert code == 1
    assert data["limits"] == {"prefill.max_req_input_len": 250, "context_length": 512, "decode.max_req_input_len": 394}
    oversize = next(r for r in data["results"] if r["probe"] == "oversize")
    assert any("prefill 400 / decode 200" in e for e in oversize["evidence"])


def test_budget_bounds_requests(capsys: pytest.CaptureFixture[str]) -> None:
    node = FakeNode(pool_tokens=600)
    with serve(node.routes()) as url:
        code, data = run_probe(capsys, url, "--api", "native", "--max-requests", "3")
    assert code == 2 and data["requests"] == 3 and "budget" in data["stopped"]
    assert node.requests == 3


def test_openai_endpoint(capsys: pytest.CaptureFixture[str]) -> None:
    node = FakeNode(pool_tokens=256)

    def completions(h, body):  # noqa: ANN001
        ids = body["prompt"]
        if isinstance(ids, list) and len(ids) >= node.limit:
            h.reply(400, {"object": "error", "message": "too long"})
        else:
            h.reply(200, {"choices": [{"text": "ok"}], "usage": {"prompt_tokens": 3, "completion_tokens": 1}})

    routes = node.routes()
    del routes[("POST", "/generate")]
    routes[("POST", "/v1/completions")] = completions
    with serve(routes) as url:
        code, data = run_probe(capsys, url, "--probes", "determinism,oversize")
    assert data["endpoint"].startswith("OpenAI") and code == 0


def test_unreachable_and_hostile_targets_exit_2_without_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["probe", f"http://127.0.0.1:{free_port()}"]) == 2
    routes = {("POST", "/generate"): bytes_route(b"<html>"), ("GET", "/server_info"): bytes_route(b"{x")}
    with serve(routes) as url:
        assert main(["probe", url, "--api", "native", "--timeout", "1"]) == 2
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err and "no prompt limit" in out.out


def test_slow_generate_is_bounded(capsys: pytest.CaptureFixture[str]) -> None:
    node = FakeNode(pool_tokens=256)
    routes = node.routes()
    routes[("POST", "/generate")] = slow(10, {"text": "x"})
    with serve(routes) as url:
        code = main(
            ["probe", url, "--json", "--api", "native", "--timeout", "1", "--time-budget", "6", "--probes", "oversize"]
        )
    data = json.loads(capsys.readouterr().out)
    assert code == 1 and data["elapsed_s"] < 8
    assert "no answer" in data["results"][0]["evidence"][0]


def test_non_loopback_needs_confirmation(capsys: pytest.CaptureFixture[str]) -> None:
    assert check_loopback(["http://127.0.0.1:1", "http://localhost:2"]) == []
    assert check_loopback(["http://10.1.2.3:1"]) == ["http://10.1.2.3:1"]
    assert main(["probe", "http://10.1.2.3:30000"]) == 2
    assert "--allow-non-loopback" in capsys.readouterr().out


def test_help_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["probe", "--help"])
    assert "oversized" in capsys.readouterr().out


def test_malformed_generate_bodies_do_not_crash(capsys: pytest.CaptureFixture[str]) -> None:
    node = FakeNode(pool_tokens=256)
    routes = node.routes()
    routes[("POST", "/generate")] = json_route({"text": 5, "meta_info": "x"})
    with serve(routes) as url:
        code, data = run_probe(capsys, url, "--api", "native", "--probes", "determinism,oversize")
    assert code == 1  # 200 with garbage to an oversized prompt is still not a refusal
    assert verdicts(data)["determinism"] == "inconclusive"
