"""The digest side channel: board, body validation, and decode's bounded fetch against a real local HTTP server."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from sglang_harden.compat import digest_board, digest_channel
from sglang_harden.compat.digest_board import DigestBoard, PublishedShard, parse_digest_body
from sglang_harden.compat.digest_channel import fetch_digests


def test_board_keeps_every_rank_of_a_room() -> None:
    board = DigestBoard()
    board.post(PublishedShard(5, 0, (1, 2)))
    board.post(PublishedShard(5, 1, (3, 4)))
    assert board.lookup(5) == {0: (1, 2), 1: (3, 4)}
    assert board.lookup(6) == {}


def test_board_is_bounded_in_count_and_time() -> None:
    board = DigestBoard(capacity=2, ttl_s=0.05)
    for room in (1, 2, 3):
        board.post(PublishedShard(room, 0, (room,)))
    assert board.lookup(1) == {} and board.lookup(3) == {0: (3,)}
    time.sleep(0.1)
    assert board.lookup(3) == {}


@pytest.mark.parametrize(
    "body",
    [b"[]", b'{"room": 1, "rank": 0}', b'{"room": 1, "rank": -1, "values": [1]}',
     b'{"room": 1, "rank": 0, "values": []}', b'{"room": 1, "rank": 0, "values": [18446744073709551615]}',
     b'{"room": "1", "rank": 0, "values": [1]}'],
)
def test_malformed_bodies_are_refused(body: bytes) -> None:
    with pytest.raises(ValueError):
        parse_digest_body(body)


def test_valid_body_parses() -> None:
    assert parse_digest_body(b'{"room": 9, "rank": 1, "values": [-1, 2]}') == PublishedShard(9, 1, (-1, 2))


class _Prefill:
    """A stand-in bootstrap server (http.server, HTTP/1.0: it closes the connection after every answer) serving
    the digest routes from a board; ``refuse_puts`` answers every PUT with 503, ``busy_puts`` the first ones."""

    def __init__(self, publishing: bool, route: bool = True, refuse_puts: bool = False,
                 keep_alive: bool = False, busy_puts: int = 0) -> None:
        self.board = DigestBoard()
        self.busy_puts = busy_puts  # the first ones are answered 503 (a busy board)
        self.connections = 0
        self.drop_after_answer = False
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1" if keep_alive else "HTTP/1.0"

            def setup(self) -> None:
                outer.connections += 1
                super().setup()

            def do_PUT(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if refuse_puts or self.path != digest_channel.DIGEST_PATH or outer.busy_puts > 0:
                    outer.busy_puts -= 1
                    self.send_response(503)
                else:
                    outer.board.post(parse_digest_body(body))
                    self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self) -> None:  # noqa: N802
                url = urlparse(self.path)
                if not route or url.path != digest_channel.DIGESTS_PATH:
                    self.send_response(404)
                    self.end_headers()
                    return
                room = int(parse_qs(url.query)["room"][0])
                body = json.dumps(digest_board.digests_payload(room, publishing, outer.board)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                self.close_connection = self.close_connection or outer.drop_after_answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.addr = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture()
def prefill() -> Iterator[_Prefill]:
    server = _Prefill(publishing=True)
    yield server
    server.server.shutdown()


def test_fetch_returns_published_shards(prefill: _Prefill) -> None:
    prefill.board.post(PublishedShard(3, 0, (7, 8)))
    got = fetch_digests(prefill.addr, 3, 30.0, lambda shards: 0 in shards)
    assert got.shards == {0: (7, 8)} and got.reason == ""


def test_fetch_keeps_its_connection_open_and_replaces_a_closed_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(digest_channel, "HTTP_TIMEOUT_S", 60.0)  # a slow answer on a loaded host is not a drop
    server = _Prefill(publishing=True, keep_alive=True)
    server.board.post(PublishedShard(3, 0, (7,)))
    for _ in range(5):
        assert fetch_digests(server.addr, 3, 30.0, lambda shards: 0 in shards).shards == {0: (7,)}
    assert server.connections == 1
    server.drop_after_answer = True  # answers once more, then hangs up without saying so (an idle timeout)
    for _ in range(3):
        assert fetch_digests(server.addr, 3, 30.0, lambda shards: 0 in shards).shards == {0: (7,)}
    assert server.connections == 3  # the dropped connection was replaced at once, twice
    server.server.shutdown()


def test_fetch_waits_for_a_late_publish(prefill: _Prefill) -> None:
    threading.Timer(0.2, prefill.board.post, args=(PublishedShard(4, 0, (1,)),)).start()
    got = fetch_digests(prefill.addr, 4, 30.0, lambda shards: bool(shards))
    assert got.shards == {0: (1,)}


def test_fetch_gives_up_within_its_bound_and_says_it_timed_out(prefill: _Prefill) -> None:
    start = time.monotonic()
    got = fetch_digests(prefill.addr, 99, 1.0, lambda shards: bool(shards))
    assert got.shards == {} and got.timed_out
    # On a loaded host not one query may have been answered within the wait; both reasons say so.
    assert "no digest for room 99 within 1.0 s" in got.reason or "did not answer" in got.reason, got.reason
    assert time.monotonic() - start < 1.0 + 2.0  # the last query is capped by what is left of the wait


def test_fetch_of_some_ranks_only_times_out(prefill: _Prefill) -> None:
    prefill.board.post(PublishedShard(8, 0, (1,)))
    got = fetch_digests(prefill.addr, 8, 5.0, lambda shards: {0, 1} <= set(shards))
    assert got.timed_out and got.shards == {0: (1,)} and "not every rank's digest" in got.reason, got


def test_an_unreachable_prefill_is_retried_then_reported_as_timed_out() -> None:
    gone = _Prefill(publishing=True)
    gone.server.shutdown()
    gone.server.server_close()
    start = time.monotonic()
    got = fetch_digests(gone.addr, 1, 0.5, lambda shards: bool(shards))
    assert got.timed_out and got.shards == {} and "did not answer" in got.reason, got
    assert time.monotonic() - start < 0.5 + 2.0


def test_publish_now_posts_before_returning(prefill: _Prefill) -> None:
    publisher = digest_channel.DigestPublisher(f"http://{prefill.addr}", timeout_s=30.0)
    for room in (1, 2, 3):  # the stand-in closes each connection: every publish after the first reconnects
        assert publisher.publish_now(PublishedShard(room, 0, (room, -room)))
        assert prefill.board.lookup(room) == {0: (room, -room)}


def test_publisher_reports_a_refused_or_unreachable_board() -> None:
    refusing = _Prefill(publishing=True, refuse_puts=True)
    assert not digest_channel.DigestPublisher(f"http://{refusing.addr}", 30.0).publish_now(PublishedShard(1, 0, (1,)))
    refusing.server.shutdown()
    refusing.server.server_close()
    start = time.monotonic()
    gone = digest_channel.DigestPublisher(f"http://{refusing.addr}", timeout_s=0.5)
    assert not gone.publish_now(PublishedShard(1, 0, (1,)))
    assert time.monotonic() - start < 2 * 0.5 + 2.0  # two tries, each bounded


def test_a_queued_post_the_board_did_not_take_is_posted_again() -> None:
    busy = _Prefill(publishing=True, busy_puts=2)
    publisher = digest_channel.DigestPublisher(f"http://{busy.addr}", timeout_s=30.0)
    publisher.publish(PublishedShard(5, 0, (5, -5)))
    assert publisher.flush(timeout_s=10.0)
    assert busy.board.lookup(5) == {0: (5, -5)} and busy.busy_puts == 0
    busy.server.shutdown()


def test_a_queued_post_is_retried_within_a_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(digest_channel, "POST_RETRY_S", 0.5)
    refusing = _Prefill(publishing=True, refuse_puts=True)
    publisher = digest_channel.DigestPublisher(f"http://{refusing.addr}", timeout_s=30.0)
    start = time.monotonic()
    publisher.publish(PublishedShard(6, 0, (6,)))
    assert publisher.flush(timeout_s=10.0)
    assert time.monotonic() - start < 0.5 + 2.0 and refusing.board.lookup(6) == {}
    assert refusing.busy_puts <= -2  # tried more than once
    refusing.server.shutdown()


def test_fetch_returns_at_once_when_prefill_does_not_publish() -> None:
    for server, words in ((_Prefill(publishing=False), "does not publish"), (_Prefill(True, route=False), "not hard")):
        start = time.monotonic()
        got = fetch_digests(server.addr, 1, 30.0, lambda shards: bool(shards))
        server.server.shutdown()
        assert got.shards == {} and words in got.reason and not got.timed_out
        assert time.monotonic() - start < 10.0  # not the 30 s wait


def test_digest_timer_reports_count_mean_and_worst_per_phase() -> None:
    from sglang_harden.compat.kv_digest import DigestTimer

    timer = DigestTimer()
    assert timer.report() == {}
    for seconds in (0.001, 0.003):
        timer.add("verify", seconds)
    timer.add("publish", 0.0005)
    assert timer.report() == {
        "verify": {"count": 2, "mean_us": 2000.0, "max_us": 3000.0},
        "publish": {"count": 1, "mean_us": 500.0, "max_us": 500.0},
    }
