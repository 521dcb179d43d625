"""Control-plane authentication on SGLang's real bootstrap server, in one process: run under a pin venv.

SGLang's ``CommonKVBootstrapServer`` (its aiohttp app, its own routes, and the routes sglang-harden adds) runs
on a loopback port with the compat hooks installed and a secret file configured. Asserted:

- an unsigned, forged, stale or replayed request to any control route gets 401 and changes nothing in the
  server's state; ``/health`` stays open; a request without a valid token is refused before its body arrives;
- a signed request replayed to another bootstrap server is refused there (issue 39);
- SGLang's own bootstrap client (the ``requests`` name in ``common/conn.py``) signs, and is served; it and our own
  clients take no answer the server did not sign for their request;
- rotation: a server holding (new, old) accepts both; log mode serves and counts;
- fuzzing (hypothesis; ``SGLANG_HARDEN_FUZZ_EXAMPLES`` per route, 1000 by default): bodies, queries and headers
  of any shape get a 4xx, never a 5xx, unsigned ones never change state, and the server stays healthy;
  10 MB bodies get 413; a client that never finishes its request does not stall others, and gets 408 once the
  body read timeout passes, with its connection closed.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import socket
import time
from typing import Any

import pytest

pytest.importorskip("sglang")
requests = pytest.importorskip("requests")

from fuzz_strategies import bodies, fuzz_signed, fuzz_unsigned  # noqa: E402

from sglang_harden import compat, events  # noqa: E402
from sglang_harden.compat import bootstrap_http, control_auth  # noqa: E402
from sglang_harden.compat.runtime import RUNTIME  # noqa: E402
from sglang_harden.config import Mode  # noqa: E402
from sglang_harden.guards.bootstrap_auth import HEADER, MIN_SECRET_CHARS, NonceCache, parse_secrets, sign  # noqa: E402
from sglang_harden.testbed.patched_bootstrap import registration, wait_healthy  # noqa: E402
from sglang_harden.testbed.procs import free_port  # noqa: E402
from sglang_harden.testbed.soak_requests import ROUTE_TABLE_QUERY  # noqa: E402

SECRET = "s" * MIN_SECRET_CHARS
NEXT = "t" * MIN_SECRET_CHARS
FUZZ_EXAMPLES = int(os.environ.get("SGLANG_HARDEN_FUZZ_EXAMPLES", "1000"))
ROUTES = [
    ("PUT", "/route"), ("GET", "/route"), ("POST", "/register_dp_rank"), ("POST", "/query_dp_ranks"),
    ("PUT", "/pd_rejections"), ("GET", "/pd_rejections"), ("PUT", "/sglang_harden/digest"),
    ("GET", "/sglang_harden/digests"), ("GET", "/sglang_harden/digest_feed"),
]
STATE_SKIP = {"app", "lock", "thread", "_runner", "_loop", "loop", "_background_tasks", "_site"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    secret_file = tmp_path_factory.mktemp("auth") / "secret"
    secret_file.write_text(SECRET + "\n")
    secret_file.chmod(0o600)
    os.environ["SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE"] = str(secret_file)
    compat.activate("integration-test")
    compat.reconfigure()  # another module of this run may have activated without the secret
    from sglang.srt.disaggregation.common import conn

    assert "bootstrap_auth" in RUNTIME.armed
    assert control_auth.signing_client_in_place(conn)
    port = free_port()
    instance = conn.CommonKVBootstrapServer("127.0.0.1", port)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, timeout_s=20)
    AUTHORITY["addr"] = base.removeprefix("http://")
    yield {"base": base, "addr": base.removeprefix("http://"), "port": port, "conn": conn, "server": instance,
           "file": secret_file}
    os.environ.pop("SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE", None)


def _state(instance: Any) -> str:
    """Everything the bootstrap server keeps about routes and ranks, as text."""
    kept = {k: v for k, v in vars(instance).items() if k not in STATE_SKIP and not callable(v)}
    return repr(sorted((k, repr(copy.copy(v))) for k, v in kept.items()))


AUTHORITY: dict[str, str] = {}  # the module's server, once the fixture started it


def _signed_headers(method: str, target: str, body: bytes, secret: str = SECRET, **kwargs: Any) -> dict[str, str]:
    return {HEADER: sign(parse_secrets(secret), method, AUTHORITY["addr"], target, body, **kwargs)}


CLIENT = requests.Session()  # keep-alive: the fuzz cases reuse one connection


def _send(base: str, method: str, target: str, body: bytes = b"", headers: dict[str, str] | None = None) -> Any:
    return CLIENT.request(method, base + target, data=body, headers=headers or {}, timeout=10, auth=None)


@pytest.mark.parametrize("method,path", ROUTES)
def test_unsigned_requests_are_refused_and_change_nothing(server: dict[str, Any], method: str, path: str) -> None:
    before = _state(server["server"])
    body = json.dumps(registration(17000)).encode() if method != "GET" else b""
    counts = events.snapshot()
    answer = _send(server["base"], method, path, body)
    assert answer.status_code == 401, answer.text
    assert "sgh" not in answer.text
    assert _state(server["server"]) == before
    assert events.snapshot().get("bootstrap_auth:reject", 0) == counts.get("bootstrap_auth:reject", 0) + 1


def test_health_stays_open(server: dict[str, Any]) -> None:
    assert _send(server["base"], "GET", "/health").status_code == 200


def test_sglang_bootstrap_client_signs_and_is_served(server: dict[str, Any]) -> None:
    """The registration SGLang's prefill sends, through the ``requests`` name its bootstrap code uses."""
    before = _state(server["server"])
    answer = server["conn"].requests.put(server["base"] + "/route", json=registration(17000), timeout=10)
    assert answer.status_code == 200, answer.text
    assert _state(server["server"]) != before, "the registration took effect"
    session = server["conn"].requests.Session()
    assert session.get(server["base"] + ROUTE_TABLE_QUERY, timeout=10).status_code < 500


def test_forged_stale_and_replayed_tokens_are_refused(server: dict[str, Any]) -> None:
    base, target = server["base"], "/pd_rejections?rooms=1,2"
    assert _send(base, "GET", target, headers=_signed_headers("GET", target, b"", secret=NEXT)).status_code == 401
    stale = _signed_headers("GET", target, b"", now=time.time() - 3600)
    assert _send(base, "GET", target, headers=stale).status_code == 401
    wrong_path = _signed_headers("GET", "/pd_rejections?rooms=3", b"")
    assert _send(base, "GET", target, headers=wrong_path).status_code == 401
    once = _signed_headers("GET", target, b"")
    assert _send(base, "GET", target, headers=once).status_code == 200
    assert _send(base, "GET", target, headers=once).status_code == 401, "the same token again is a replay"


def test_rotation_in_place_accepts_current_and_next(server: dict[str, Any]) -> None:
    """Rewriting the secret file is picked up within a second, without a restart: (next, current) signs with
    next and accepts both; then (next) alone refuses the old secret."""
    base, target, secret_file = server["base"], "/pd_rejections?rooms=5", server["file"]
    try:
        secret_file.write_text(f"{NEXT}\n{SECRET}\n")
        time.sleep(1.1)
        for secret in (SECRET, NEXT):
            assert _send(base, "GET", target, headers=_signed_headers("GET", target, b"", secret)).status_code == 200
        assert control_auth.current().refreshed().signing == NEXT.encode(), "new tokens use the first secret"
        secret_file.write_text(f"{NEXT}\n")
        time.sleep(1.1)
        assert _send(base, "GET", target, headers=_signed_headers("GET", target, b"", SECRET)).status_code == 401
        secret_file.write_text("short\n")  # a broken edit keeps the last good secrets
        time.sleep(1.1)
        assert _send(base, "GET", target, headers=_signed_headers("GET", target, b"", NEXT)).status_code == 200
    finally:
        secret_file.write_text(SECRET + "\n")
        time.sleep(1.1)
        control_auth.current().refreshed()


def test_log_mode_serves_and_counts(server: dict[str, Any]) -> None:
    saved = RUNTIME.config
    RUNTIME.config = dataclasses.replace(saved, bootstrap_auth=Mode.LOG)
    try:
        counts = events.snapshot().get("bootstrap_auth:reject_logged", 0)
        assert _send(server["base"], "GET", "/pd_rejections?rooms=9").status_code == 200
        assert events.snapshot().get("bootstrap_auth:reject_logged", 0) == counts + 1
    finally:
        RUNTIME.config = saved


def test_ten_megabyte_body_is_refused(server: dict[str, Any]) -> None:
    body = b"x" * (10 << 20)
    answer = _send(server["base"], "PUT", "/pd_rejections", body, _signed_headers("PUT", "/pd_rejections",
                                                                                          body))
    assert answer.status_code == 413
    assert _send(server["base"], "GET", "/health").status_code == 200


def test_a_client_that_never_finishes_does_not_stall_others(server: dict[str, Any]) -> None:
    port = int(server["base"].rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as slow:
        slow.sendall(b"PUT /route HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{")
        target = "/pd_rejections?rooms=11"
        started = time.monotonic()
        assert _send(server["base"], "GET", target, headers=_signed_headers("GET", target, b"")).status_code == 200
        assert time.monotonic() - started < 2


def test_a_body_that_never_arrives_gets_408_and_the_connection_closes(server: dict[str, Any],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A valid token (made for a body the client then never finishes sending)."""
    monkeypatch.setattr(bootstrap_http, "BODY_READ_TIMEOUT_S", 1.0)
    port = server["port"]
    before = _state(server["server"])
    token = _signed_headers("PUT", "/route", b"{" + b" " * 99_999)[HEADER].encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:
        started = time.monotonic()
        slow.sendall(b"PUT /route HTTP/1.1\r\nHost: %s\r\n%s: %s\r\nContent-Length: 100000\r\n\r\n{"
                     % (server["addr"].encode(), HEADER.encode(), token))
        answer = slow.recv(4096)
        waited = time.monotonic() - started
        slow.settimeout(5)
        closed = slow.recv(4096) == b""
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert 0.9 <= waited < 5, waited  # answered at the bound
    assert closed  # and the server dropped the connection
    assert _state(server["server"]) == before


BODIES = bodies(registration(17000))


@pytest.mark.parametrize("method,path", ROUTES)
def test_fuzz_unsigned_and_forged(server: dict[str, Any], method: str, path: str) -> None:
    fuzz_unsigned(lambda verb, target, body, headers: _send(server["base"], verb, target, body, headers), method,
                  path, BODIES, FUZZ_EXAMPLES, state=lambda: _state(server["server"]))


def test_signed_registration_with_an_infinite_port_gets_400(server: dict[str, Any]) -> None:
    """JSON's ``Infinity`` as the port SGLang's handler turns into an int (the fuzzer's find: ``int(inf)`` raised
    an OverflowError that the server answered with 500)."""
    before = _state(server["server"])
    body = json.dumps({**registration(17000), "rank_port": float("inf")}).encode()
    answer = _send(server["base"], "PUT", "/route", body, _signed_headers("PUT", "/route", body))
    assert answer.status_code == 400, (answer.status_code, answer.text[:200])
    assert _state(server["server"]) == before


@pytest.mark.parametrize("method,path", ROUTES)
def test_fuzz_signed_malformed_bodies_get_4xx(server: dict[str, Any], method: str, path: str) -> None:
    """A secret holder sending garbage (a bug, or a compromised node): a 4xx or a 2xx, never a 5xx."""
    fuzz_signed(lambda verb, target, body, headers: _send(server["base"], verb, target, body, headers),
                _signed_headers, method, path, BODIES, max(100, FUZZ_EXAMPLES // 5))
    assert _send(server["base"], "GET", "/health").status_code == 200


def test_our_clients_sign_and_are_served(server: dict[str, Any]) -> None:
    """sglang-harden's own abort and digest clients, through the routes they use in production (a PUT the token
    check has already read must still reach the handler with its body)."""
    from sglang_harden.compat import digest_channel, notify

    addr = server["base"].removeprefix("http://")
    room = 987_654_321
    body = json.dumps({"room": room, "status_code": 400, "message": "too long", "sent_kv": False}).encode()
    answer = _send(server["base"], "PUT", notify.ROUTE, body, control_auth.outgoing_headers(
        "PUT", server["addr"], notify.ROUTE, body))
    assert answer.status_code == 200, answer.text
    found = notify.fetch_aborts(addr, [room])
    assert [a.room for a in found] == [room] and found[0].message == "too long"
    digest = json.dumps({"room": room, "rank": 0, "values": [1, 2, 3, 4]}).encode()
    status, reply = digest_channel.CONNECTIONS.request("PUT", addr, digest_channel.DIGEST_PATH, 5.0, digest)
    assert status == 200, reply
    status, reply = digest_channel.CONNECTIONS.request("GET", addr, f"{digest_channel.DIGESTS_PATH}?room={room}", 5.0)
    assert status == 200 and json.loads(reply)["shards"] == {"0": [1, 2, 3, 4]}, reply



@pytest.mark.parametrize("token", [None, "sgh1.x.y.z", "forged"])
def test_a_request_without_a_valid_token_is_refused_before_its_body_arrives(server: dict[str, Any],
                                                                           monkeypatch: pytest.MonkeyPatch,
                                                                           token: str | None) -> None:
    """Issue 39: the server read the body (up to 1 MiB, for up to 10 s) before it looked at the token."""
    monkeypatch.setattr(bootstrap_http, "BODY_READ_TIMEOUT_S", 5.0)
    port = server["port"]
    if token == "forged":
        token = _signed_headers("PUT", "/route", b"{", secret=NEXT)[HEADER]
    header = b"" if token is None else f"{HEADER}: {token}\r\n".encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:
        started = time.monotonic()
        slow.sendall(b"PUT /route HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n%sContent-Length: 1000000\r\n\r\n{"
                     % (port, header))
        answer = slow.recv(4096)
        waited = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert waited < 2, waited


def test_a_signed_registration_replayed_to_another_bootstrap_server_is_refused(server: dict[str, Any],
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 39: the MAC bound neither the Host nor the server. Another prefill's bootstrap server is another
    process, with a replay cache of its own: here each replay meets a fresh cache. The other server listens on
    another port, then on another address with the same port."""
    conn = server["conn"]
    other_port = free_port()
    other = conn.CommonKVBootstrapServer("127.0.0.1", other_port)
    other_base = f"http://127.0.0.1:{other_port}"
    wait_healthy(other_base, timeout_s=20)
    before = _state(other)
    for addressed in (None, server["base"].removeprefix("http://")):
        sent = conn.requests.put(server["base"] + "/route", json=registration(17003), timeout=10)
        assert sent.status_code == 200
        headers = {HEADER: sent.request.headers[HEADER], "Content-Type": "application/json"}
        if addressed:
            headers["Host"] = addressed
        monkeypatch.setattr(control_auth.current(), "nonces", NonceCache(60))
        replayed = _send(other_base, "PUT", "/route", sent.request.body, headers)
        assert replayed.status_code == 401, (addressed, replayed.status_code, replayed.text)
    assert _state(other) == before
    same_port = conn.CommonKVBootstrapServer("127.0.0.2", server["port"])
    wait_healthy(f"http://127.0.0.2:{server['port']}", timeout_s=20)
    before = _state(same_port)
    sent = conn.requests.put(server["base"] + "/route", json=registration(17004), timeout=10)
    assert sent.status_code == 200
    monkeypatch.setattr(control_auth.current(), "nonces", NonceCache(60))
    replayed = _send(f"http://127.0.0.2:{server['port']}", "PUT", "/route", sent.request.body,
                     {HEADER: sent.request.headers[HEADER], "Content-Type": "application/json",
                      "Host": server["addr"]})
    assert replayed.status_code == 401 and "does not name this bootstrap server" in replayed.text, replayed.text
    assert _state(same_port) == before


class _Forger:
    """A server that answers every request 200 with a forged body (a man in the middle, or a spoofed address)."""

    def __init__(self, body: bytes) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_PUT = do_POST = _answer  # noqa: N815

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.addr = f"127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_forged_route_answer_is_not_trusted(server: dict[str, Any]) -> None:
    """Issue 39: decode used whatever answered at the bootstrap address (the ranks it then connects to)."""
    forged = json.dumps({"rank_ip": "6.6.6.6", "rank_port": 6666}).encode()
    fake = _Forger(forged)
    try:
        url = f"http://{fake.addr}/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"
        for answer in (server["conn"].requests.get(url, timeout=5),
                       server["conn"].requests.Session().get(url, timeout=5),
                       server["conn"].requests.post(f"http://{fake.addr}/query_dp_ranks", json={}, timeout=5)):
            assert answer.status_code == 502 and "not signed" in answer.text, (answer.status_code, answer.text)
        api = server["conn"].requests.Session().post(f"http://{fake.addr}/generate", json={}, timeout=5)
        assert api.status_code == 200, "prefill's HTTP API (0.5.23's retraction /generate) is no bootstrap route"
        assert HEADER not in api.request.headers
    finally:
        fake.close()


def test_a_forged_abort_answer_is_not_trusted(server: dict[str, Any]) -> None:
    """Issue 39: the same for our own clients (a forged rejection aborts a request)."""
    from sglang_harden.compat import notify

    room = 5_550_001
    fake = _Forger(json.dumps({"rooms": {str(room): {"status_code": 400, "message": "forged",
                                                     "sent_kv": False}}}).encode())
    try:
        assert notify.fetch_aborts(fake.addr, [room]) == []
    finally:
        fake.close()


def test_a_token_with_a_unicode_digit_gets_401_not_500(server: dict[str, Any]) -> None:
    """Issue 39: ``"²".isdigit()`` passed and ``int("²")`` raised: a 500."""
    port = server["port"]
    token = ("sgh1.\u00b2." + "a" * 32 + "." + "b" * 64).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=15) as raw:
        raw.sendall(b"GET /pd_rejections?rooms=1 HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n%s: %s\r\nConnection: close\r\n\r\n"
                    % (port, HEADER.encode(), token))
        answer = raw.recv(4096)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
