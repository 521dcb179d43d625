"""The backport series' control-plane authentication on SGLang's real bootstrap server: run under a pin venv.

The pin's series (``patches/<pin>``) is applied to a copy of the files it touches, taken from the venv's SGLang.
A subprocess (``sglang_harden.testbed.patched_bootstrap``, plugin off) runs the patched ``CommonKVBootstrapServer``
with a secret file and, once serving, registers a prefill rank through SGLang's own bootstrap client and posts a
rejection notice through ``pd_rejections``: both are served, so the patched clients sign. Asserted from outside:

- every route but ``/health`` answers 401 to an unsigned, forged, stale or replayed request, or one signed for
  another bootstrap server, before its body arrives where the token decides; and a refused request changes nothing
  (the route table and the rejection board, read back with a valid token);
- a token signed by the plugin's code (same secret) is served, and the answer carries a signature the plugin's
  code accepts: plugin and patched nodes interoperate;
- fuzzing (hypothesis): unsigned bodies, queries and tokens of any shape get 401 (``FUZZ_EXAMPLES`` per route:
  a fifth of ``SGLANG_HARDEN_FUZZ_EXAMPLES``, 200 by default; the token check runs before any route's handler
  and is the plugin's, fuzzed with 1000 per route in ``test_control_auth_inprocess.py``); signed malformed
  bodies get a 4xx or 2xx, never a 5xx (half that count); the server stays up;
- a 10 MB body gets 413.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sglang = pytest.importorskip("sglang")
requests = pytest.importorskip("requests")

from fuzz_strategies import bodies, fuzz_signed, fuzz_unsigned  # noqa: E402

from sglang_harden.guards.bootstrap_auth import (  # noqa: E402
    ANSWER_HEADER,
    HEADER,
    MIN_SECRET_CHARS,
    check_answer,
    parse_secrets,
    sign,
)
from sglang_harden.testbed.envs import REPO_ROOT  # noqa: E402
from sglang_harden.testbed.patched import copy_series_files  # noqa: E402
from sglang_harden.testbed.patched_bootstrap import REJECTED_ROOM, registration  # noqa: E402
from sglang_harden.testbed.procs import free_port  # noqa: E402
from sglang_harden.testbed.soak_requests import ROUTE_TABLE_QUERY  # noqa: E402
from sglang_harden.tools import patch as patch_tool  # noqa: E402

SECRET = "p" * MIN_SECRET_CHARS
OTHER = "q" * MIN_SECRET_CHARS
FUZZ_EXAMPLES = max(50, int(os.environ.get("SGLANG_HARDEN_FUZZ_EXAMPLES", "1000")) // 5)
ROUTES = [("PUT", "/route"), ("GET", "/route"), ("POST", "/register_dp_rank"), ("POST", "/query_dp_ranks"),
          ("PUT", "/pd_rejections"), ("GET", "/pd_rejections")]
PIN = sglang.__version__

pytestmark = pytest.mark.skipif(
    PIN not in patch_tool.available_pins(patch_tool.default_patches_dir())
    or not any("authenticate-control-plane" in p.name
               for p in patch_tool.load_series(PIN, patch_tool.default_patches_dir())),
    reason=f"no authentication patch in a series for SGLang {PIN}")


def _patched_files(dest: Path) -> Path:
    """The series' targets (and version files) copied from the venv's SGLang, then patched."""
    copy_series_files(PIN, Path(sglang.__file__).resolve().parent.parent, dest)
    report = patch_tool.apply_series(dest, PIN)
    assert report.ok, report.message
    return dest


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("patched-auth")
    tree = _patched_files(root / "tree")
    secret_file = root / "secret"
    secret_file.write_text(SECRET + "\n")
    secret_file.chmod(0o600)
    port = free_port()
    env = {**os.environ, "SGLANG_HARDEN_ACTIVATE": "0", "SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE": str(secret_file),
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    log = (root / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "sglang_harden.testbed.patched_bootstrap", str(tree), str(port)],
                            stdout=subprocess.PIPE, stderr=log, text=True, env=env, start_new_session=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line:
            proc.wait(10)
            pytest.fail(f"the patched bootstrap server exited ({proc.returncode}): "
                        f"{(root / 'server.log').read_text()[-2000:]}")
        AUTHORITY["addr"] = f"127.0.0.1:{port}"
        yield {"base": f"http://127.0.0.1:{port}", "port": port, "report": json.loads(line), "tree": tree,
               "log": root / "server.log"}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


CLIENT = requests.Session()


def _send(base: str, method: str, target: str, body: bytes = b"", headers: dict[str, str] | None = None) -> Any:
    return CLIENT.request(method, base + target, data=body, headers=headers or {}, timeout=10)


AUTHORITY: dict[str, str] = {}  # the patched server's host:port, once the fixture started it


def _signed(method: str, target: str, body: bytes = b"", secret: str = SECRET, authority: str | None = None,
            **kwargs: Any) -> dict[str, str]:
    return {HEADER: sign(parse_secrets(secret), method, authority or AUTHORITY["addr"], target, body, **kwargs)}


RANK_QUERY = "/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank=0&target_pp_rank=0"


def _read_state(base: str) -> tuple[str, str, str]:
    """The server's layout, the registered rank 0 and the rejection board for the rooms these tests touch, read
    with valid tokens."""
    board = f"/pd_rejections?rooms={REJECTED_ROOM},{REJECTED_ROOM + 1}"
    answers = [_send(base, "GET", target, headers=_signed("GET", target))
               for target in (ROUTE_TABLE_QUERY, RANK_QUERY, board)]
    assert all(a.status_code == 200 for a in answers), [(a.status_code, a.text) for a in answers]
    layout, rank, rejections = (a.text for a in answers)
    return layout, rank, rejections


def test_patched_clients_sign_and_are_served(server: dict[str, Any]) -> None:
    """SGLang's own client (``conn.requests``) registered a rank and ``pd_rejections`` posted a notice."""
    report = server["report"]
    assert report["authenticated"] is True, report
    assert Path(report["conn_file"]).is_relative_to(server["tree"]), report
    assert report["client_register_status"] == 200, report
    assert report["rejection_posted"] is True, report
    layout, rank, board = _read_state(server["base"])
    assert str(REJECTED_ROOM) in json.loads(board)["rooms"], board
    assert json.loads(layout)["attn_tp_size"] == 1, layout
    assert "127.0.0.1" in rank and "17000" in rank, rank


@pytest.mark.parametrize("method,path", ROUTES)
def test_unsigned_requests_are_refused_and_change_nothing(server: dict[str, Any], method: str, path: str) -> None:
    before = _read_state(server["base"])
    body = b""
    if method != "GET":
        payload = {"room": REJECTED_ROOM + 1, "status_code": 400, "message": "forged"} if "pd_rejections" in path \
            else dict(registration(17001), rank_ip="127.0.0.2", bootstrap_room=REJECTED_ROOM + 1)
        body = json.dumps(payload).encode()
    answer = _send(server["base"], method, path, body)
    assert answer.status_code == 401, answer.text
    assert _read_state(server["base"]) == before


def test_health_stays_open(server: dict[str, Any]) -> None:
    assert _send(server["base"], "GET", "/health").status_code == 200


def test_forged_stale_and_replayed_tokens_are_refused(server: dict[str, Any]) -> None:
    base, target = server["base"], f"/pd_rejections?rooms={REJECTED_ROOM}"
    assert _send(base, "GET", target, headers=_signed("GET", target, secret=OTHER)).status_code == 401
    stale = _signed("GET", target, now=time.time() - 3600)
    assert _send(base, "GET", target, headers=stale).status_code == 401
    assert _send(base, "GET", target, headers=_signed("GET", "/pd_rejections?rooms=1")).status_code == 401
    elsewhere = _signed("GET", target, authority="10.9.9.9:8998")
    assert _send(base, "GET", target, headers=elsewhere).status_code == 401, "signed for another server"
    assert _send(base, "GET", target, headers={**elsewhere, "Host": "10.9.9.9:8998"}).status_code == 401
    once = _signed("GET", target)
    answer = _send(base, "GET", target, headers=once)
    assert answer.status_code == 200, "the plugin's token is served"
    assert check_answer(parse_secrets(SECRET), once[HEADER], 200, answer.headers.get(ANSWER_HEADER),
                        answer.content).allows, "and its answer is signed for it"
    assert _send(base, "GET", target, headers=once).status_code == 401, "the same token again is a replay"
    log = server["log"].read_text()
    assert "pd_auth: refused GET /pd_rejections" in log and "replayed" in log and "does not name" in log
    assert "sgh1." not in log and "sgh2." not in log, "a refusal's log line quoted a token"


def test_ten_megabyte_body_is_refused(server: dict[str, Any]) -> None:
    body = b"x" * (10 * 1024 * 1024)
    answer = _send(server["base"], "PUT", "/pd_rejections", body, _signed("PUT", "/pd_rejections", body))
    assert answer.status_code == 413


BODIES = bodies([*registration(0), "room", "status_code", "message", "bootstrap_room"])


@pytest.mark.parametrize("method,path", ROUTES)
def test_fuzz_unsigned_and_forged(server: dict[str, Any], method: str, path: str) -> None:
    fuzz_unsigned(lambda verb, target, body, headers: _send(server["base"], verb, target, body, headers), method,
                  path, BODIES, FUZZ_EXAMPLES, state=lambda: _read_state(server["base"]))


@pytest.mark.parametrize("method,path", ROUTES)
def test_fuzz_signed_malformed_bodies_get_4xx(server: dict[str, Any], method: str, path: str) -> None:
    """A secret holder sending garbage (a bug, or a compromised node): a 4xx or a 2xx, never a 5xx."""
    fuzz_signed(lambda verb, target, body, headers: _send(server["base"], verb, target, body, headers),
                _signed, method, path, BODIES, max(50, FUZZ_EXAMPLES // 2))
    assert _send(server["base"], "GET", "/health").status_code == 200



@pytest.mark.parametrize("token", [None, "sgh1.x.y.z", "forged"])
def test_a_request_without_a_valid_token_is_refused_before_its_body_arrives(server: dict[str, Any],
                                                                           token: str | None) -> None:
    import socket

    """Issue 39: the server read the body (up to 1 MiB, for up to 10 s) before it looked at the token."""
    port = server["port"]
    if token == "forged":
        token = _signed("PUT", "/route", b"{", secret=OTHER)[HEADER]
    header = b"" if token is None else f"{HEADER}: {token}\r\n".encode()
    with socket.create_connection(("127.0.0.1", port), timeout=15) as slow:
        started = time.monotonic()
        slow.sendall(b"PUT /route HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n%sContent-Length: 1000000\r\n\r\n{"
                     % (port, header))
        answer = slow.recv(4096)
        waited = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
    assert waited < 2, waited


def test_a_token_with_a_unicode_digit_gets_401_not_500(server: dict[str, Any]) -> None:
    """Issue 39: ``"²".isdigit()`` passed and ``int("²")`` raised: a 500."""
    import socket

    port = server["port"]
    token = ("sgh1.\u00b2." + "a" * 32 + "." + "b" * 64).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=15) as raw:
        raw.sendall(b"GET /pd_rejections?rooms=1 HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n%s: %s\r\nConnection: close\r\n\r\n"
                    % (port, HEADER.encode(), token))
        answer = raw.recv(4096)
    assert answer.startswith(b"HTTP/1.1 401"), answer[:200]
