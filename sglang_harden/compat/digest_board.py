"""Prefill's side of the digest channel: the board its bootstrap server keeps, and the bodies of its routes.

:class:`DigestBoard` holds each room's per-rank shard digests (bounded in count and time) and a log of posts
that decode's feed reader follows from a cursor; :class:`PostSignal` wakes the feed queries waiting for a post.
The functions here parse what the routes receive and build what they answer (the routes themselves are added in
:mod:`.bootstrap_routes`; the clients are in :mod:`.digest_channel`). This module knows no SGLang names.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

BOARD_CAPACITY = 16384
BOARD_TTL_S = 900.0
MAX_VALUES = 4096
MAX_RANKS = 1024
FEED_MAX_WAIT_MS = 10_000
FEED_MAX_POSTS = 512  # posts per feed answer; the reader asks again at once for the rest


@dataclass(frozen=True)
class PublishedShard:
    room: int
    rank: int
    values: tuple[int, ...]


class DigestBoard:
    """Per room, the packed shard digest of each prefill rank; bounded in count and time (oldest first).

    Every post also gets a sequence number in a bounded log, which :meth:`feed` reads from a cursor. ``epoch``
    names this board's lifetime, so a reader notices a restarted prefill (its sequence starts again)."""

    def __init__(self, capacity: int = BOARD_CAPACITY, ttl_s: float = BOARD_TTL_S) -> None:
        self._capacity = capacity
        self._ttl_s = ttl_s
        self._rooms: OrderedDict[int, tuple[float, dict[int, tuple[int, ...]]]] = OrderedDict()
        self._log: deque[tuple[int, PublishedShard]] = deque(maxlen=capacity)
        self._seq = 0
        self.epoch = os.urandom(8).hex()
        self._lock = threading.Lock()

    def post(self, shard: PublishedShard) -> None:
        now = time.monotonic()
        with self._lock:
            stamp, ranks = self._rooms.pop(shard.room, (now, {}))
            ranks[shard.rank] = shard.values
            self._rooms[shard.room] = (stamp, ranks)
            while len(self._rooms) > self._capacity:
                self._rooms.popitem(last=False)
            self._seq += 1
            self._log.append((self._seq, shard))

    def lookup(self, room: int) -> dict[int, tuple[int, ...]]:
        now = time.monotonic()
        with self._lock:
            while self._rooms:
                oldest, (stamp, _) = next(iter(self._rooms.items()))
                if now - stamp < self._ttl_s:
                    break
                del self._rooms[oldest]
            entry = self._rooms.get(room)
            return dict(entry[1]) if entry else {}

    def feed(self, since: int | None, limit: int = FEED_MAX_POSTS) -> tuple[int, bool, list[PublishedShard]]:
        """``(cursor, complete, posts)``: the posts after ``since`` (at most ``limit``, oldest first) and the
        cursor to ask from next. ``complete`` is False when posts after ``since`` were already dropped from the
        log, or ``since`` is not a cursor of this board; then ``posts`` is empty and the cursor is the newest."""
        with self._lock:
            oldest = self._log[0][0] if self._log else self._seq + 1
            if since is None or since > self._seq or since + 1 < oldest:
                return self._seq, False, []
            posts = [shard for seq, shard in self._log if seq > since][:limit]
            return since + len(posts), True, posts

    def newest(self) -> int:
        with self._lock:
            return self._seq


class PostSignal:
    """Wakes feed queries that wait for the next post. Used on the bootstrap server's event loop only (the
    PUT handler calls :meth:`notify`, the feed handler awaits :meth:`wait`)."""

    def __init__(self) -> None:
        self._waiters: set[asyncio.Future[None]] = set()

    async def wait(self, timeout_s: float) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:
            await asyncio.wait_for(waiter, timeout_s)
        except TimeoutError:
            pass
        finally:
            self._waiters.discard(waiter)

    def notify(self) -> None:
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)


BOARD = DigestBoard()
POSTED = PostSignal()


def post_and_signal(shard: PublishedShard) -> None:
    """The PUT handler's action: put the shard on the board and wake the feed queries waiting for a post."""
    BOARD.post(shard)
    POSTED.notify()


def parse_digest_body(body: bytes) -> PublishedShard:
    """Validate a PUT body; raise ValueError with a short reason on anything malformed."""
    data = json.loads(body)
    if not isinstance(data, dict):
        raise ValueError("body must be a JSON object")
    room, rank, values = data.get("room"), data.get("rank"), data.get("values")
    if not isinstance(room, int) or not isinstance(rank, int) or not isinstance(values, list):
        raise ValueError("need integer room, integer rank, list of integer values")
    if not 0 <= rank < MAX_RANKS:
        raise ValueError(f"rank must be in [0, {MAX_RANKS})")
    if not 0 < len(values) <= MAX_VALUES or not all(isinstance(v, int) and -(2**63) <= v < 2**63 for v in values):
        raise ValueError(f"values must be 1..{MAX_VALUES} signed 64-bit integers")
    return PublishedShard(room, rank, tuple(values))


def digests_payload(room: int, publishing: bool, board: DigestBoard | None = None) -> dict[str, object]:
    shards = (board or BOARD).lookup(room)
    return {"publishing": publishing, "shards": {str(rank): list(values) for rank, values in shards.items()}}


@dataclass(frozen=True)
class FeedQuery:
    since: int | None
    epoch: str
    wait_s: float


def parse_feed_query(query: dict[str, str]) -> FeedQuery:
    """Validate a feed query's parameters; raise ValueError with a short reason on anything malformed."""
    try:
        since = int(query["since"]) if query.get("since", "") != "" else None
        wait_ms = int(query.get("wait_ms", "0"))
    except ValueError:
        raise ValueError("since and wait_ms must be integers") from None
    if since is not None and since < 0:
        raise ValueError("since must be >= 0")
    if not 0 <= wait_ms <= FEED_MAX_WAIT_MS:
        raise ValueError(f"wait_ms must be in [0, {FEED_MAX_WAIT_MS}]")
    return FeedQuery(since, query.get("epoch", ""), wait_ms / 1000)


def feed_payload(ask: FeedQuery, publishing: bool, board: DigestBoard | None = None) -> dict[str, object]:
    """The answer to a feed query; a query of another epoch (prefill restarted) is answered as incomplete."""
    board = board or BOARD
    since = ask.since if ask.epoch == board.epoch else None
    cursor, complete, posts = board.feed(since)
    return {
        "publishing": publishing,
        "epoch": board.epoch,
        "cursor": cursor,
        "complete": complete,
        "posts": [[p.room, p.rank, list(p.values)] for p in posts],
    }


def feed_has_news(ask: FeedQuery, board: DigestBoard | None = None) -> bool:
    """Whether a feed query can be answered at once (something posted after it, or it needs resetting)."""
    board = board or BOARD
    return ask.since is None or ask.epoch != board.epoch or board.newest() != ask.since
