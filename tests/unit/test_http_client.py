"""The side channels' HTTP client against a real loopback HTTP server: kept-alive connections (one TCP connection
for many requests from one thread), the signer's headers on every request and its check of every answer, a capped
answer, bounded retries with their pauses, and a server gone between requests."""

from __future__ import annotations

import http.client
import http.server
from collections.abc import Iterator
from typing import Any

import pytest
from loopback_http import serving

from sglang_harden.channels.http_client import SideChannelClient, UntrustedAnswer


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[tuple[str, str, str | None, int]] = []
    statuses: list[int] = []

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        _Handler.seen.append((self.command, self.path, self.headers.get("X-Token"), self.client_address[1]))
        status = _Handler.statuses.pop(0) if _Handler.statuses else 200
        body = b"x" * 5000 if self.path == "/big" else b'{"ok": true}'
        self.send_response(status)
        self.send_header("X-Answer", f"for {self.headers.get('X-Token')}")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PUT = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    _Handler.seen, _Handler.statuses = [], []
    with serving(_Handler) as addr:
        yield addr


class _Signer:
    """Signs with the method, authority, path and body length; trusts an answer that names the request's token."""

    def __init__(self, trust: bool = True) -> None:
        self.trust = trust
        self.checked: list[tuple[str, int, str]] = []

    def headers(self, method: str, authority: str, target: str, body: bytes | str | None) -> dict[str, str]:
        return {"X-Token": f"{method} {authority} {target} {len(body or b'')}"}

    def answer_refusal(self, sent: Any, status: int, answer: Any, body: bytes, **about: object) -> str | None:
        self.checked.append((sent["X-Token"], status, str(about["url"])))
        return None if self.trust and answer.get("X-Answer") == f"for {sent['X-Token']}" else "not signed"


def test_one_connection_carries_many_requests_each_signed(server: str) -> None:
    signer = _Signer()
    client = SideChannelClient(signer)
    for n in range(5):
        assert client.request("PUT", server, f"/p{n}", 2.0, b"abc") == (200, b'{"ok": true}')
    ports = {port for *_, port in _Handler.seen}
    assert len(ports) == 1, "kept alive: one client port for all five"
    assert [token for _, _, token, _ in _Handler.seen] == [f"PUT {server} /p{n} 3" for n in range(5)]
    assert [status for _, status, _ in signer.checked] == [200] * 5


def test_an_answer_the_signer_refuses_is_no_answer_and_not_retried(server: str) -> None:
    signer = _Signer()
    client = SideChannelClient(signer)
    assert client.request("GET", server, "/first", 2.0)[0] == 200  # a kept connection it could retry on
    signer.trust = False
    _Handler.seen.clear()
    with pytest.raises(UntrustedAnswer, match="not signed"):
        client.request("GET", server, "/route", 2.0)
    assert [path for _, path, _, _ in _Handler.seen] == ["/route"], "sent once"


def test_an_answer_over_the_cap_is_refused(server: str) -> None:
    client = SideChannelClient(max_answer_bytes=1000)
    with pytest.raises(http.client.HTTPException, match="longer than 1000"):
        client.request("GET", server, "/big", 2.0)
    assert client.request("GET", server, "/small", 2.0)[0] == 200


def test_retries_are_bounded_and_stop_at_the_first_success(server: str) -> None:
    pauses: list[float] = []
    client = SideChannelClient(sleep=pauses.append)
    _Handler.statuses = [503, 503, 200]
    assert client.request_until("PUT", server, "/n", 2.0, b"{}", attempts=5, pause_s=0.2) == (200, "")
    assert len(_Handler.seen) == 3 and pauses == [0.2, 0.4]
    _Handler.statuses = [503] * 10
    assert client.request_until("PUT", server, "/n", 2.0, b"{}", attempts=4, pause_s=0.1) == (503, "")
    assert len(_Handler.seen) == 3 + 4


def test_an_unreachable_server_is_reported_after_the_bounded_attempts() -> None:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = SideChannelClient(sleep=lambda s: None)
    status, failure = client.request_until("GET", f"127.0.0.1:{port}", "/", 0.5, attempts=3, pause_s=0.0)
    assert status is None and "ConnectionRefused" in failure


def test_a_kept_connection_the_server_dropped_is_replaced(server: str) -> None:
    client = SideChannelClient()
    assert client.request("GET", server, "/a", 2.0)[0] == 200
    kept = client._local.connections[server]
    kept.sock.close()  # the kept connection broke between requests
    assert client.request("GET", server, "/b", 2.0)[0] == 200
    assert client._local.connections[server] is not kept
