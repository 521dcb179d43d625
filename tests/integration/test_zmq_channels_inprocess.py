"""The ZMQ side channels' sockets on real pyzmq loopback sockets, in one process: run under a pin venv.

A PULL rank port switched to the verifying class and a PUSH switched to the signing class, as the hooks switch
SGLang's own sockets. Asserted: signed messages arrive byte-identical without the auth frame; unsigned, forged,
replayed or mis-addressed ones never reach the reader in enforce (and are counted), and are served in log mode;
the reader gets the next good message behind refused ones; where the caller polls first, a refusal reads as
"nothing yet"; a listener loop that raises is run again, and one whose socket closed ends.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")

from sglang_harden import events  # noqa: E402
from sglang_harden.compat import zmq_channels, zmq_listeners  # noqa: E402
from sglang_harden.compat.runtime import RUNTIME  # noqa: E402
from sglang_harden.compat.zmq_sockets import Inbox, make_signing, make_verifying  # noqa: E402
from sglang_harden.config import HardenConfig, Mode  # noqa: E402
from sglang_harden.guards.bootstrap_auth import MIN_SECRET_CHARS, parse_secrets  # noqa: E402
from sglang_harden.guards.zmq_auth import Signer  # noqa: E402
from sglang_harden.testbed.plugin_config import secret_in_force, write_secret  # noqa: E402

SECRET = "z" * MIN_SECRET_CHARS


class Refuse:
    """Wire rules that refuse messages starting with b"bad"."""

    def problem(self, frames: list[bytes], sender: bytes | None) -> str | None:
        return "bad message" if frames and frames[0].startswith(b"bad") else None

    def kind(self, frames: list[bytes]) -> str:
        return "test"


@pytest.fixture
def configured(tmp_path: Path) -> Iterator[None]:
    with secret_in_force(write_secret(tmp_path / "secret", SECRET)):
        yield


def _mode(**changes: Any) -> None:
    RUNTIME.config = dataclasses.replace(RUNTIME.config, **changes)


@pytest.fixture
def pair() -> Iterator[tuple[Any, Any, str]]:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    endpoint = f"tcp://127.0.0.1:{port}"
    make_verifying(pull, Inbox(f"127.0.0.1:{port}", "prefill test", Refuse()))
    push = ctx.socket(zmq.PUSH)
    push.connect(endpoint)
    try:
        yield pull, push, endpoint
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


def _recv(pull: Any, timeout_ms: int = 2000) -> list[bytes] | None:
    """The next admitted message within ``timeout_ms``, else None. Never a blocking receive: after a refusal with
    nothing behind it the verifying socket would wait for the next message, for ever if none comes."""
    deadline = time.monotonic() + timeout_ms / 1000
    while (left := deadline - time.monotonic()) > 0:
        if pull.poll(int(left * 1000) + 1):
            try:
                return pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:  # refused; look again until the deadline
                continue
    return None


def _raw(push: Any, frames: list[bytes]) -> None:
    zmq.Socket.send_multipart(push, frames)


def test_signed_messages_arrive_as_sent_and_the_rest_never(configured: None, pair: Any) -> None:
    pull, push, endpoint = pair
    keyring = parse_secrets(SECRET)
    attacker = Signer()
    _raw(push, [b"x"])  # unsigned
    _raw(push, [b"x", attacker.sign(parse_secrets("w" * MIN_SECRET_CHARS), [b"x"], endpoint)])  # another secret
    _raw(push, [b"x", attacker.sign(keyring, [b"x"], "tcp://127.0.0.1:1")])  # signed for another rank port
    replayed = [b"r", attacker.sign(keyring, [b"r"], endpoint)]
    _raw(push, replayed)
    _raw(push, replayed)
    make_signing(push, endpoint)
    push.send_multipart([b"hello", memoryview(b"world")])
    assert _recv(pull) == [b"r"], "the first use of a signed message arrives"
    assert _recv(pull) == [b"hello", b"world"], "the refused ones never do; the good one behind them does"
    counts = events.snapshot()
    assert counts.get("zmq_auth:reject", 0) == 4, counts


def test_log_mode_serves_unsigned_and_counts(configured: None, pair: Any) -> None:
    pull, push, _ = pair
    _mode(zmq_auth=Mode.LOG)
    _raw(push, [b"plain"])
    assert _recv(pull) == [b"plain"]
    assert events.snapshot().get("zmq_auth:reject_logged", 0) == 1


def test_not_signing_sends_plain_frames(configured: None, pair: Any) -> None:
    pull, push, endpoint = pair
    _mode(zmq_auth=Mode.LOG, zmq_sign=False)
    make_signing(push, endpoint)
    push.send_multipart([b"plain"])
    assert _recv(pull) == [b"plain"]


def test_wire_rules_drop_after_auth(configured: None, pair: Any) -> None:
    pull, push, endpoint = pair
    make_signing(push, endpoint)
    push.send_multipart([b"bad", b"1"])
    push.send_multipart([b"good"])
    assert _recv(pull) == [b"good"]
    assert events.snapshot().get("side_channels:reject", 0) == 1


def test_without_a_secret_a_signed_peers_frame_is_removed(pair: Any) -> None:
    pull, push, endpoint = pair
    saved = RUNTIME.config
    RUNTIME.config = HardenConfig()
    try:
        _raw(push, [b"m", Signer().sign(parse_secrets(SECRET), [b"m"], endpoint)])
        assert _recv(pull) == [b"m"]
    finally:
        RUNTIME.config = saved


def test_a_polling_reader_gets_none_for_a_refusal(configured: None, pair: Any) -> None:
    pull, push, _ = pair
    pull._sgh_returns_none = True
    _raw(push, [b"x"])
    assert pull.poll(2000)
    assert pull.recv_multipart() is None
    with pytest.raises(zmq.Again):
        _raw(push, [b"y"])
        time.sleep(0.2)
        pull.recv_multipart(zmq.NOBLOCK)


def test_a_listener_that_raises_runs_again_and_ends_with_its_socket() -> None:
    calls: list[int] = []

    def bootstrap_thread() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise IndexError("list index out of range")
        return "done"

    assert zmq_listeners.restarting(bootstrap_thread, "bootstrap_thread", lambda name, exc: None)() == "done"
    assert len(calls) == 3

    def decode_thread() -> None:
        raise zmq.ZMQError(zmq.ETERM)

    assert zmq_listeners.restarting(decode_thread, "decode_thread", lambda name, exc: None)() is None


def test_backend_threads_of_listener_loops_are_restarting() -> None:
    import types

    module = types.ModuleType("fake_conn")
    module.threading = threading
    zmq_channels.listeners_restart(module)
    assert zmq_listeners.listeners_restarting(module)
    seen: list[str] = []

    def decode_listener_thread() -> None:
        seen.append("ran")
        if len(seen) == 1:
            raise ValueError("bad frame")

    thread = module.threading.Thread(target=decode_listener_thread, daemon=True)
    thread.start()
    thread.join(5)
    assert seen == ["ran", "ran"] and not thread.is_alive()
    assert module.threading.Lock is threading.Lock


def test_peer_sockets_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zmq_channels, "MAX_PEER_SOCKETS", 3)
    ctx = zmq.Context()

    class Manager:
        def __init__(self) -> None:
            self._socket_cache: dict[str, Any] = {}
            self._monitor_cache: dict[str, Any] = {}
            self._socket_send_locks: dict[str, threading.Lock] = {}
            self._socket_lock = threading.Lock()

        def _connect(self, endpoint: str, is_ipv6: bool = False) -> Any:
            sock = self._socket_cache.get(endpoint)
            if sock is None:
                sock = self._socket_cache[endpoint] = ctx.socket(zmq.PUSH)
                self._socket_send_locks[endpoint] = threading.Lock()
            return sock

    connect = zmq_channels.cap_manager_sockets(Manager._connect)
    manager = Manager()
    busy = "tcp://127.0.0.1:2"
    for port in range(1, 7):
        if port == 3:
            manager._socket_send_locks[busy].acquire()
        connect(manager, f"tcp://127.0.0.1:{port}")
    assert list(manager._socket_cache) == [busy, "tcp://127.0.0.1:5", "tcp://127.0.0.1:6"], \
        "oldest idle sockets closed; the one being sent on kept"
    manager._socket_send_locks[busy].release()
    for sock in manager._socket_cache.values():
        sock.close(linger=0)
    ctx.term()


def test_status_says_what_runs(configured: None) -> None:
    from sglang_harden.compat import zmq_settings

    assert zmq_settings.auth_configured()
    assert zmq_settings.status() == "enforce"
    _mode(zmq_sign=False, zmq_auth=Mode.LOG)
    assert zmq_settings.status() == "log (not signing)"
    _mode(zmq_auth=Mode.OFF)
    assert zmq_settings.status() == "unauthenticated" and not zmq_settings.auth_configured()


def test_staging_prefetch_sockets_sign(configured: None, pair: Any) -> None:
    """Prefill's STAGING_REQ goes out on sockets SGLang's staging handler opens itself (0.5.19+). Unhooked (the
    pin's own function), decode's rank port in enforce drops it: staging would stall. Through the hook, the socket
    signs before its first send and the request arrives as SGLang wrote it."""
    staging = pytest.importorskip("sglang.srt.disaggregation.common.staging_handler")
    pull, _, endpoint = pair
    pull._sgh_returns_none = True  # a refused message with nothing behind it reads as None (else recv waits on)
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    infos = {7: {"session-a": type("Info", (), {"is_dummy": False, "dst_kv_indices": [0, 1], "endpoint": host,
                                                 "dst_port": int(port)})()}}
    before = events.snapshot().get("zmq_auth:reject", 0)
    own = inspect.unwrap(staging.prefetch_staging_reqs)  # SGLang's, past hooks an earlier test installed
    hooked = zmq_channels.sign_staging_sockets(own)
    for prefetch, expected in ((own, None), (hooked, b"STAGING_REQ")):
        sockets: dict = {}
        try:
            prefetch(7, infos, {"page_size": 1}, 64, set(), sockets)
            got = _recv(pull, 1500)
            assert (got[0] if got else None) == expected, (prefetch, got)
            if expected is not None:
                assert got[1:4] == [b"7", b"0", b"2"] and got[4] == b"session-a", got
                assert list(sockets) == [endpoint] and type(sockets[endpoint]).__name__ == "SigningSocket"
        finally:
            for sock in sockets.values():
                sock.close(linger=0)
    assert events.snapshot().get("zmq_auth:reject", 0) == before + 1
