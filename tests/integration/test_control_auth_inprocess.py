"""Control-plane authentication on SGLang's real bootstrap server, in one process: run under a pin venv.

SGLang's ``CommonKVBootstrapServer`` (its aiohttp app, its own routes, and the routes sglang-harden adds) runs
on a loopback port with the compat hooks installed and a secret file configured. Asserted:

- an unsigned, forged, stale or replayed request to any control route gets 401 and changes nothing in the
  server's state; ``/health`` stays open;
- SGLang's own bootstrap client (the ``requests`` name in ``common/conn.py``) signs, and is served;
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
from sglang_harden.compat import control_auth  # noqa: E402
from sglang_harden.compat.runtime import RUNTIME  # noqa: E402
from sglang_harden.config import Mode  # noqa: E402
from sglang_harden.guards.bootstrap_auth import HEADER, MIN_SECRET_CHARS, parse_secrets, sign  # noqa: E402
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
    yield {"base": base, "conn": conn, "server": instance, "file": secret_file}
    os.environ.pop("SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE", None)


def _state(instance: Any) -> str:
    """Everything the bootstrap server keeps about routes and ranks, as text."""
    kept = {k: v for k, v in vars(instance).items() if k not in STATE_SKIP and not callable(v)}
    return repr(sorted((k, repr(copy.copy(v))) for k, v in kept.items()))


def _signed_headers(method: str, target: str, body: bytes, secret: str = SECRET) -> dict[str, str]:
    return {HEADER: sign(parse_secrets(secret), method, target, body)}


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
    assert "sgh1" not in answer.text
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
    stale = {HEADER: sign(parse_secrets(SECRET), "GET", target, b"", now=time.time() - 3600)}
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
    monkeypatch.setattr(control_auth, "BODY_READ_TIMEOUT_S", 1.0)
    port = int(server["base"].rsplit(":", 1)[1])
    before = _state(server["server"])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as slow:
        started = time.monotonic()
        slow.sendall(b"PUT /route HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{")
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
        "PUT", notify.ROUTE, body))
    assert answer.status_code == 200, answer.text
    found = notify.fetch_aborts(addr, [room])
    assert [a.room for a in found] == [room] and found[0].message == "too long"
    digest = json.dumps({"room": room, "rank": 0, "values": [1, 2, 3, 4]}).encode()
    status, reply = digest_channel.CONNECTIONS.request("PUT", addr, digest_channel.DIGEST_PATH, 5.0, digest)
    assert status == 200, reply
    status, reply = digest_channel.CONNECTIONS.request("GET", addr, f"{digest_channel.DIGESTS_PATH}?room={room}", 5.0)
    assert status == 200 and json.loads(reply)["shards"] == {"0": [1, 2, 3, 4]}, reply
