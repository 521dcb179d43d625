"""The digest feed end to end on real HTTP: sglang-harden's own bootstrap-server handlers (PUT digest, GET feed,
GET digests) in an aiohttp app on loopback, decode's :class:`DigestFeed` reader and prefill's background
:class:`DigestPublisher`. Needs aiohttp (SGLang's venvs have it; skipped under a python without it)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from sglang_harden.compat import bootstrap_routes, digest_board, digest_channel  # noqa: E402
from sglang_harden.compat.digest_board import DigestBoard, PublishedShard  # noqa: E402
from sglang_harden.compat.digest_channel import DigestFeed  # noqa: E402


class Receiver:
    """What the feed keeps a weak reference to (decode's KV receiver for the room)."""


class Bootstrap:
    """An aiohttp app with the digest routes of a hardened prefill bootstrap server, on its own loop thread."""

    def __init__(self, with_feed: bool = True) -> None:
        app = web.Application()
        app.router.add_put(digest_channel.DIGEST_PATH, bootstrap_routes.handle_digest_put)
        app.router.add_get(digest_channel.DIGESTS_PATH, bootstrap_routes.handle_digests_get)
        if with_feed:
            app.router.add_get(digest_channel.FEED_PATH, bootstrap_routes.handle_digest_feed_get)
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(app)
        ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.addr = f"127.0.0.1:{self.runner.addresses[0][1]}"
        ready.set()
        self.loop.run_forever()

    def post(self, shard: PublishedShard) -> None:
        """A post as the PUT handler makes it (board + wake the waiting feed queries), on the server's loop."""
        self.loop.call_soon_threadsafe(digest_board.post_and_signal, shard)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture()
def board(monkeypatch: pytest.MonkeyPatch) -> DigestBoard:
    fresh = DigestBoard()
    monkeypatch.setattr(digest_board, "BOARD", fresh)
    monkeypatch.setattr(digest_board, "POSTED", digest_board.PostSignal())
    return fresh


@pytest.fixture()
def prefill(board: DigestBoard) -> Iterator[Bootstrap]:
    server = Bootstrap()
    yield server
    server.stop()


def _until(condition, timeout_s: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def _covering_feed(addr: str, room: int) -> tuple[DigestFeed, list[Receiver]]:
    """A feed whose reader of ``addr`` has its cursor, then watches ``room`` (covered: every post for it comes
    through). The receivers are returned to keep them alive (the feed holds them weakly)."""
    feed, keep = DigestFeed(), [Receiver(), Receiver()]
    feed.watch(addr, -1, keep[0])
    _until(lambda: feed._prefills[addr].cursor is not None)
    feed.watch(addr, room, keep[1])
    return feed, keep


def test_board_feed_reads_from_a_cursor_in_order_and_in_bounded_batches() -> None:
    board = DigestBoard(capacity=8)
    assert board.feed(None) == (0, False, [])
    shards = [PublishedShard(room, 0, (room,)) for room in range(5)]
    for shard in shards:
        board.post(shard)
    assert board.feed(0) == (5, True, shards)
    assert board.feed(2, limit=2) == (4, True, shards[2:4])
    assert board.feed(5) == (5, True, [])


def test_board_feed_says_incomplete_when_posts_were_dropped_or_the_cursor_is_foreign() -> None:
    board = DigestBoard(capacity=3)
    for room in range(6):
        board.post(PublishedShard(room, 0, (room,)))
    assert board.feed(1) == (6, False, [])  # posts 2 and 3 fell out of the log
    assert board.feed(3)[1:] == (True, [PublishedShard(r, 0, (r,)) for r in (3, 4, 5)])
    assert board.feed(99) == (6, False, [])  # a cursor of another board (prefill restarted)


@pytest.mark.parametrize("query", [{"since": "x"}, {"since": "-1"}, {"wait_ms": "-5"}, {"wait_ms": "999999"}])
def test_malformed_feed_queries_are_refused(query: dict[str, str]) -> None:
    with pytest.raises(ValueError):
        digest_board.parse_feed_query(query)


def test_feed_delivers_a_digest_posted_before_the_commit_without_asking_the_board(
    prefill: Bootstrap, monkeypatch: pytest.MonkeyPatch
) -> None:
    feed, _keep = _covering_feed(prefill.addr, 7)
    prefill.post(PublishedShard(7, 0, (1, 2)))
    _until(lambda: feed._prefills[prefill.addr].rooms[7].shards)

    def no_direct_fetch(*args: object) -> None:
        raise AssertionError("the feed had the digest: no board query expected")

    monkeypatch.setattr(digest_channel, "fetch_digests", no_direct_fetch)
    got = digest_channel.receive_digests(feed, prefill.addr, 7, 5.0, lambda shards: 0 in shards)
    assert got.shards == {0: (1, 2)} and not got.timed_out and got.via == "feed"
    assert 7 not in feed._prefills[prefill.addr].rooms  # taken rooms are forgotten


def test_feed_waits_for_a_late_post_and_wakes_on_it(prefill: Bootstrap) -> None:
    feed, _keep = _covering_feed(prefill.addr, 8)
    threading.Timer(0.3, prefill.post, args=(PublishedShard(8, 1, (5,)),)).start()
    began = time.monotonic()
    got = feed.take(prefill.addr, 8, 20.0, lambda shards: 1 in shards)
    assert got is not None and got.shards == {1: (5,)}
    assert time.monotonic() - began < 10.0  # woken by the post, not by the end of the wait


def test_a_room_the_feed_cannot_vouch_for_is_read_from_the_board(prefill: Bootstrap, board: DigestBoard) -> None:
    feed = DigestFeed()
    receiver = Receiver()
    feed.watch(prefill.addr, 9, receiver)  # registered before the reader had a cursor: not covered
    board.post(PublishedShard(9, 0, (3,)))
    assert feed.take(prefill.addr, 9, 0.2, lambda shards: 0 in shards) is None
    got = digest_channel.receive_digests(feed, prefill.addr, 9, 5.0, lambda shards: 0 in shards)
    assert got.shards == {0: (3,)} and got.via == "board"


def test_a_missing_digest_times_out_within_the_wait(prefill: Bootstrap) -> None:
    feed, _keep = _covering_feed(prefill.addr, 10)
    began = time.monotonic()
    got = digest_channel.receive_digests(feed, prefill.addr, 10, 0.5, lambda shards: 0 in shards)
    assert got.timed_out and got.shards == {}
    assert time.monotonic() - began < 0.5 + 3.0  # the feed's wait, then one last bounded board query


def test_a_restarted_prefill_makes_watched_rooms_fall_back_to_the_board(
    prefill: Bootstrap, monkeypatch: pytest.MonkeyPatch
) -> None:
    feed, _keep = _covering_feed(prefill.addr, 11)
    restarted = DigestBoard()  # a new epoch: the reader's cursor means nothing there
    monkeypatch.setattr(digest_board, "BOARD", restarted)
    prefill.post(PublishedShard(11, 0, (4,)))  # wakes the waiting query, which answers "incomplete"
    _until(lambda: feed._prefills[prefill.addr].epoch == restarted.epoch)
    assert not feed._prefills[prefill.addr].rooms[11].covered
    got = digest_channel.receive_digests(feed, prefill.addr, 11, 5.0, lambda shards: 0 in shards)
    assert got.shards == {0: (4,)}


def test_a_prefill_without_the_feed_route_is_read_from_the_board(board: DigestBoard) -> None:
    older = Bootstrap(with_feed=False)
    try:
        feed = DigestFeed()
        first, second = Receiver(), Receiver()
        feed.watch(older.addr, 12, first)
        _until(lambda: not feed._prefills[older.addr].running)  # the reader saw the 404 and stopped
        assert not feed._prefills[older.addr].usable
        feed.watch(older.addr, 13, second)
        assert not feed._prefills[older.addr].running, "a prefill known to have no feed is not asked again"
        board.post(PublishedShard(13, 0, (6,)))
        got = digest_channel.receive_digests(feed, older.addr, 13, 5.0, lambda shards: 0 in shards)
        assert got.shards == {0: (6,)}
    finally:
        older.stop()


def test_the_reader_forgets_rooms_whose_receiver_is_gone_and_then_stops(
    prefill: Bootstrap, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(digest_channel, "FEED_IDLE_EXIT_S", 0.2)
    monkeypatch.setattr(digest_channel, "FEED_WAIT_MS", 100)
    feed = DigestFeed()
    receiver = Receiver()
    feed.watch(prefill.addr, 14, receiver)
    del receiver
    _until(lambda: not feed._prefills[prefill.addr].running)
    assert feed._prefills[prefill.addr].rooms == {}


def test_publisher_posts_in_the_background_in_order(prefill: Bootstrap, board: DigestBoard) -> None:
    publisher = digest_channel.DigestPublisher(f"http://{prefill.addr}", timeout_s=30.0)
    for room in range(20):
        publisher.publish(PublishedShard(room, 0, (room,)))
    assert publisher.flush(30.0)
    cursor, complete, posts = board.feed(0)
    assert complete and [p.room for p in posts] == list(range(20))


def test_publisher_drops_and_logs_past_its_queue_cap(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(digest_channel, "PUBLISH_QUEUE_CAP", 2)
    publisher = digest_channel.DigestPublisher("http://127.0.0.1:9")
    monkeypatch.setattr(publisher, "_ensure_sender", lambda: None)  # nothing drains the queue
    for room in range(3):
        publisher.publish(PublishedShard(room, 0, (room,)))
    assert "dropped the digest of room 2" in caplog.text
