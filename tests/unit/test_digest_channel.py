"""The digest side channel: board, body validation, and decode's bounded fetch against a real local HTTP server."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from sglang_harden.compat import digest_channel
from sglang_harden.compat.digest_channel import DigestBoard, PublishedShard, fetch_digests, parse_digest_body


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
    """A stand-in bootstrap server serving only the digest GET route from a board."""

    def __init__(self, publishing: bool, route: bool = True) -> None:
        self.board = DigestBoard()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                url = urlparse(self.path)
                if not route or url.path != digest_channel.DIGESTS_PATH:
                    self.send_response(404)
                    self.end_headers()
                    return
                room = int(parse_qs(url.query)["room"][0])
                body = json.dumps(digest_channel.digests_payload(room, publishing, outer.board)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

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
    got = fetch_digests(prefill.addr, 3, 1.0, lambda shards: 0 in shards)
    assert got.shards == {0: (7, 8)} and got.reason == ""


def test_fetch_waits_for_a_late_publish(prefill: _Prefill) -> None:
    threading.Timer(0.2, prefill.board.post, args=(PublishedShard(4, 0, (1,)),)).start()
    got = fetch_digests(prefill.addr, 4, 3.0, lambda shards: bool(shards))
    assert got.shards == {0: (1,)}


def test_fetch_gives_up_within_its_bound(prefill: _Prefill) -> None:
    start = time.monotonic()
    got = fetch_digests(prefill.addr, 99, 0.3, lambda shards: bool(shards))
    assert got.shards == {} and "no digest" in got.reason
    assert time.monotonic() - start < 2.0


def test_fetch_returns_at_once_when_prefill_does_not_publish() -> None:
    for server, words in ((_Prefill(publishing=False), "does not publish"), (_Prefill(True, route=False), "not hard")):
        start = time.monotonic()
        got = fetch_digests(server.addr, 1, 5.0, lambda shards: bool(shards))
        server.server.shutdown()
        assert got.shards == {} and words in got.reason
        assert time.monotonic() - start < 2.0


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
