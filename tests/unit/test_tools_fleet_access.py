"""audit and probe on a fleet's terms: an API key (SGLang's ``--api-key``), a gateway's header, TLS with a private CA
or none, and a fleet file. Each case runs the same request without the option first and shows it refused.

The servers are local fakes (``fake_sglang.py``) that answer 401 without the required header, as SGLang's
API-key check does; the TLS server's certificate is made here by ``openssl``.
"""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_sglang import FakeNode, serve

from sglang_harden.cli import main
from sglang_harden.tools import _http

KEY = "k-7f3a9c"
BEARER = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(autouse=True)
def _default_client_settings() -> Iterator[None]:
    """Each CLI run configures the process-wide client: start and end every test from the default."""
    _http.configure(_http.ClientSettings())
    yield
    _http.configure(_http.ClientSettings())


def _audit(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    code = main(["audit", "--json", "--timeout", "15", *args])
    return code, json.loads(capsys.readouterr().out)


def _key_file(tmp_path: Path, key: str = KEY) -> str:
    path = tmp_path / "api-key"
    path.write_text(key + "\n")
    path.chmod(0o400)
    return str(path)


def test_api_key_file_opens_a_node_started_with_api_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    node = FakeNode(role="prefill", pool_tokens=600)
    with serve(node.routes(), required_headers=BEARER) as url:
        code, refused = _audit(capsys, url)
        assert code == 2, refused
        assert url in refused["nodes"][0]["error"] and "--api-key-file" in refused["nodes"][0]["error"], refused
        code, audited = _audit(capsys, url, "--api-key-file", _key_file(tmp_path))
    assert audited["nodes"][0]["error"] is None, audited
    assert audited["nodes"][0]["pool_tokens"] == 600


def test_gateway_header_is_sent_with_every_request(capsys: pytest.CaptureFixture[str]) -> None:
    node = FakeNode(role="decode", pool_tokens=600)
    gateway = {"X-Gateway-Token": "g-1"}
    with serve(node.routes(), required_headers=gateway) as url:
        assert _audit(capsys, url)[0] == 2
        code, audited = _audit(capsys, url, "--header", "X-Gateway-Token: g-1")
    assert audited["nodes"][0]["error"] is None and audited["nodes"][0]["metrics"] == "ok", audited


@pytest.mark.parametrize("bad", ["no colon", "Bad Name: x", ": empty name"])
def test_malformed_header_is_a_usage_error(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["audit", "http://127.0.0.1:9", "--header", bad])
    assert exited.value.code == 2
    assert "expected 'NAME: VALUE'" in capsys.readouterr().err


def test_unreadable_or_blank_api_key_file_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for path in (str(tmp_path / "missing"), _key_file(tmp_path, key="")):
        with pytest.raises(SystemExit) as exited:
            main(["audit", "http://127.0.0.1:9", "--api-key-file", path])
        assert exited.value.code == 2
        assert path in capsys.readouterr().err


def test_authorization_given_twice_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["audit", "http://127.0.0.1:9", "--api-key-file", _key_file(tmp_path),
                 "--header", "authorization: Bearer other"])
    assert code == 2
    assert "header given twice: authorization" in capsys.readouterr().err


def test_fleet_file_lists_the_nodes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prefill = FakeNode(role="prefill", pool_tokens=600)
    decode = FakeNode(role="decode", pool_tokens=600)
    with serve(prefill.routes()) as p, serve(decode.routes()) as d:
        fleet = tmp_path / "fleet.txt"
        fleet.write_text(f"# staging pair\n{p}   # prefill\n\n{d}\n{p}\n")
        code, data = _audit(capsys, "--fleet", str(fleet))
    assert [node["url"] for node in data["nodes"]] == [p, d]  # the repeated line is audited once
    assert [node["role"] for node in data["nodes"]] == ["prefill", "decode"]


def test_fleet_file_with_a_non_url_line_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fleet = tmp_path / "fleet.txt"
    fleet.write_text("http://127.0.0.1:9\nprefill-0.internal:30000\n")
    with pytest.raises(SystemExit) as exited:
        main(["audit", "--fleet", str(fleet)])
    assert exited.value.code == 2
    assert f"{fleet}:2: not an http(s) URL" in capsys.readouterr().err


def test_no_node_at_all_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit"]) == 2
    assert "give node URLs, or --fleet FILE" in capsys.readouterr().err


@pytest.fixture(scope="module")
def private_ca(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(certificate, key) of a self-signed certificate for 127.0.0.1, made by openssl."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl not installed (the TLS cases make their certificate with it)")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def _tls_server(cert: Path, key: Path) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(cert), str(key))
    return context


def test_tls_with_a_private_ca(private_ca: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    cert, key = private_ca
    node = FakeNode(role="prefill", pool_tokens=600)
    with serve(node.routes(), tls=_tls_server(cert, key)) as url:
        assert url.startswith("https://")
        code, refused = _audit(capsys, url)
        assert code == 2 and "TLS certificate not verified" in refused["nodes"][0]["error"], refused
        assert url in refused["nodes"][0]["error"]
        _, verified = _audit(capsys, url, "--cacert", str(cert))
        _, unverified = _audit(capsys, url, "--insecure")
    assert verified["nodes"][0]["error"] is None and verified["nodes"][0]["pool_tokens"] == 600, verified
    assert unverified["nodes"][0]["error"] is None, unverified


def test_cacert_and_insecure_exclude_each_other(private_ca: tuple[Path, Path],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["audit", "https://127.0.0.1:9", "--cacert", str(private_ca[0]), "--insecure"])
    assert exited.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_cacert_that_holds_no_certificate_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    junk = tmp_path / "ca.pem"
    junk.write_text("not a certificate\n")
    assert main(["audit", "https://127.0.0.1:9", "--cacert", str(junk)]) == 2
    assert f"--cacert {junk}: not usable CA certificates" in capsys.readouterr().err


def test_probe_sends_the_api_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """probe's requests carry the key too: without it the target's limits are unknown (401 named, nothing
    generated); with it the limits are read and every generate request is answered."""
    node = FakeNode(role="prefill", pool_tokens=600)
    probe = ["probe", "--json", "--probes", "determinism", "--max-requests", "4", "--timeout", "5"]
    with serve(node.routes(), required_headers=BEARER) as url:
        main([*probe, url])
        refused = capsys.readouterr()
        main([*probe, url, "--api-key-file", _key_file(tmp_path)])
        probed = json.loads(capsys.readouterr().out)
    assert "401" in refused.out + refused.err and "--api-key-file" in refused.out + refused.err, refused
    assert probed["limits"] == {"prefill.max_req_input_len": 506, "context_length": 512}, probed
    assert probed["requests"] == 4 and probed["stopped"] == "request budget of 4 used up", probed
