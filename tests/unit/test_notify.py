"""The abort side channel without SGLang: board, message validation, and a watcher against a local fake."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
from loopback_http import serving

from sglang_harden.compat import notify


def test_board_bounded_by_count_and_age() -> None:
    board = notify.AbortBoard(capacity=2, ttl_s=0.2)
    for room in (1, 2, 3):
        board.post(notify.PeerAbort(room, 400, f"r{room}"))
    assert [a.room for a in board.lookup([1, 2, 3])] == [2, 3]
    time.sleep(0.25)
    assert board.lookup([2, 3]) == []


def test_first_word_on_a_room_stands() -> None:
    board = notify.AbortBoard()
    board.post(notify.PeerAbort(9, 400, "refused at the door", sent_kv=False))
    board.post(notify.PeerAbort(9, 500, "retired later"))
    assert board.lookup([9]) == [notify.PeerAbort(9, 400, "refused at the door", sent_kv=False)]


@pytest.mark.parametrize(
    "body",
    [b"not json", b"[]", b'{"room": "1", "status_code": 400, "message": "x"}',
     b'{"room": 1, "status_code": 200, "message": "x"}', b'{"room": 1, "status_code": 400}'],
)
def test_malformed_abort_bodies_are_refused(body: bytes) -> None:
    with pytest.raises(ValueError):
        notify.parse_abort_body(body)


def test_abort_body_message_is_capped() -> None:
    abort = notify.parse_abort_body(json.dumps({"room": 5, "status_code": 400, "message": "x" * 10000}).encode())
    assert abort.room == 5 and len(abort.message) == 4096


def test_rooms_query_is_bounded() -> None:
    assert notify.parse_rooms_query("1,2, 3,") == [1, 2, 3]
    with pytest.raises(ValueError):
        notify.parse_rooms_query(",".join(str(i) for i in range(notify.MAX_ROOMS_PER_QUERY + 1)))


class _FakeBootstrap(BaseHTTPRequestHandler):
    board = notify.AbortBoard()

    def do_GET(self) -> None:  # noqa: N802 - http.server API
        rooms = notify.parse_rooms_query(parse_qs(urlparse(self.path).query).get("rooms", [""])[0])
        self._reply(notify.aborts_payload(rooms, self.board))

    def do_PUT(self) -> None:  # noqa: N802
        abort = notify.parse_abort_body(self.rfile.read(int(self.headers["Content-Length"])))
        self.board.post(abort)
        self._reply({"ok": True})

    def _reply(self, payload: dict[str, object]) -> None:
        raw = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *_args: object) -> None:
        pass


@pytest.fixture()
def bootstrap() -> Iterator[str]:
    with serving(_FakeBootstrap) as addr:
        yield addr


class _Receiver:
    pass


def _wait_for(seen: list[Any], count: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(seen) < count and time.monotonic() < deadline:
        time.sleep(0.05)


def test_publisher_to_watcher_round_trip(bootstrap: str) -> None:
    seen: list[tuple[object, notify.PeerAbort]] = []
    watcher = notify.DecodeWatcher(lambda receiver, abort: seen.append((receiver, abort)))
    waiting, other = _Receiver(), _Receiver()
    watcher.watch(bootstrap, 41, waiting)
    watcher.watch(bootstrap, 42, other)
    notify.Publisher(f"http://{bootstrap}").publish(notify.PeerAbort(41, 400, "Input length (300 tokens) exceeds"))
    _wait_for(seen, 1)
    assert seen and seen[0][0] is waiting and seen[0][1].status_code == 400
    assert watcher.hit(41) is not None and watcher.hit(42) is None


def test_never_sent_flag_survives_the_round_trip(bootstrap: str) -> None:
    seen: list[notify.PeerAbort] = []
    watcher = notify.DecodeWatcher(lambda _receiver, abort: seen.append(abort))
    receivers = [_Receiver(), _Receiver()]
    watcher.watch(bootstrap, 51, receivers[0])
    watcher.watch(bootstrap, 52, receivers[1])
    publisher = notify.Publisher(f"http://{bootstrap}")
    publisher.publish(notify.PeerAbort(51, 400, "refused at the door", sent_kv=False))
    publisher.publish(notify.PeerAbort(52, 500, "aborted after a chunk went out"))
    _wait_for(seen, 2)
    assert {a.room: a.sent_kv for a in seen} == {51: False, 52: True}


def test_rooms_leave_the_poll_once_answered_or_concluded(bootstrap: str) -> None:
    """A room with a hit, or whose receiver reached its final state, is not asked about again (receivers can
    outlive their requests by minutes; polling them for ever loads both bootstrap servers)."""
    seen: list[notify.PeerAbort] = []
    watcher = notify.DecodeWatcher(lambda _receiver, abort: seen.append(abort))
    hit, done, waiting = _Receiver(), _Receiver(), _Receiver()
    watcher.watch(bootstrap, 61, hit)
    watcher.watch(bootstrap, 62, done)
    watcher.watch(bootstrap, 63, waiting)
    notify.Publisher(f"http://{bootstrap}").publish(notify.PeerAbort(61, 500, "aborted"))
    _wait_for(seen, 1)
    done.conclude_state = "Success"  # type: ignore[attr-defined]
    time.sleep(3 * notify.POLL_INTERVAL_S)
    assert [a.room for a in seen] == [61] and watcher.hit(61) is not None
    assert {room for _addr, entries in watcher._snapshot().items() for room, _r in entries} == {63}


def test_sent_kv_defaults_to_true_and_must_be_boolean() -> None:
    body = {"room": 1, "status_code": 400, "message": "x"}
    assert notify.parse_abort_body(json.dumps(body).encode()).sent_kv is True
    assert notify.parse_abort_body(json.dumps({**body, "sent_kv": False}).encode()).sent_kv is False
    with pytest.raises(ValueError):
        notify.parse_abort_body(json.dumps({**body, "sent_kv": "no"}).encode())


@pytest.mark.parametrize(
    ("remote", "local", "same"),
    [("127.0.0.1", "0.0.0.0", True), ("::1", "::", True), ("10.1.2.3", "10.1.2.3", True),
     ("10.1.2.4", "10.1.2.3", False), ("10.1.2.4", None, False), (None, "127.0.0.1", False),
     ("not-an-ip", "127.0.0.1", False), ("fe80::1%eth0", "fe80::1", True)],
)
def test_only_this_host_may_post_aborts(remote: str | None, local: str | None, same: bool) -> None:
    assert notify.is_same_host(remote, local) is same


def test_watcher_survives_a_failing_pass(bootstrap: str) -> None:
    """A pass that raises (here the decode-side callback, once) is logged and the watcher polls on: a dead watcher
    thread would leave decode deaf to every later notice."""
    seen: list[notify.PeerAbort] = []

    def on_abort(_receiver: object, abort: notify.PeerAbort) -> None:
        if abort.room == 71:
            raise RuntimeError("callback failed")
        seen.append(abort)

    watcher = notify.DecodeWatcher(on_abort)
    receivers = [_Receiver(), _Receiver()]
    watcher.watch(bootstrap, 71, receivers[0])
    publisher = notify.Publisher(f"http://{bootstrap}")
    publisher.publish(notify.PeerAbort(71, 500, "the pass that raises"))
    time.sleep(3 * notify.POLL_INTERVAL_S)
    watcher.watch(bootstrap, 72, receivers[1])
    publisher.publish(notify.PeerAbort(72, 500, "heard after the failure"))
    _wait_for(seen, 1)
    assert [a.room for a in seen] == [72]


def test_watcher_survives_unreachable_bootstrap() -> None:
    assert notify.fetch_aborts("127.0.0.1:9", [1, 2]) == []


class _ReqState:
    """The fields of SGLang's tokenizer ``ReqState`` the front answer touches (SGLang's tokenizer process is
    exercised end to end in tests/e2e/test_guards_e2e.py; this covers the races around it)."""

    def __init__(self, input_ids: list[int]) -> None:
        import asyncio

        self.out_list: list[dict[str, Any]] = []
        self.finished = False
        self.event = asyncio.Event()
        self.obj = type("Obj", (), {"input_ids": input_ids})()


def test_front_answer_ends_only_the_request_it_was_watching() -> None:
    import asyncio
    import weakref

    from sglang_harden.compat import front_hooks

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        live, replaced, done = _ReqState([1, 2, 3]), _ReqState([4]), _ReqState([5])
        done.finished = True
        manager = type("TM", (), {})()
        manager.rid_to_state = {"a": live, "b": _ReqState([6]), "c": done}
        refusal = notify.PeerAbort(11, 400, "too long", sent_kv=False)
        for rid, state in (("a", live), ("b", replaced), ("c", done)):
            front_hooks.finish_at_front(front_hooks.FrontWait(manager, loop, rid, weakref.ref(state)), refusal)
        assert "a" not in manager.rid_to_state and live.finished and live.event.is_set()
        meta = live.out_list[-1]["meta_info"]
        assert meta["finish_reason"] == {"type": "abort", "message": "too long", "status_code": 400}
        assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 0
        # a rid whose state is another object now (a new request), or already finished, is left alone
        assert "b" in manager.rid_to_state and not replaced.out_list
        assert "c" in manager.rid_to_state and not done.out_list

    asyncio.run(scenario())
