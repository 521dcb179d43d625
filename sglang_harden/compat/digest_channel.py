"""The digest side channel: prefill publishes each request's per-rank KV digests where decode can read them.

The checksum guard needs, at decode's commit, the digests prefill computed over what it sent. They travel
through prefill's bootstrap server (the one decode already talks to), next to the abort routes:

- ``PUT /sglang_harden/digest``             a prefill rank posts ``{room, rank, values}`` (packed shard)
- ``GET /sglang_harden/digests?room=R``     decode reads every rank's shard for the room, and whether this
                                            prefill publishes digests at all (``publishing``)
- ``GET /sglang_harden/digest_feed?since=C&epoch=E&wait_ms=W``
                                            every post after cursor ``C``, answered as soon as there is one
                                            (or after ``W`` ms): decode's feed reader (:class:`DigestFeed`)

Neither side waits for the channel on its scheduler thread when it need not. Prefill hands the post to a
background thread (:class:`DigestPublisher`), so the send is not delayed by an HTTP round trip; decode starts
reading the feed of a prefill node as soon as a receiver for one of its rooms exists, so the digest is usually
already in decode's memory when the transfer finishes. At commit decode waits a bounded time
(``checksum_wait_ms``) for the room's digests; a room the feed does not cover (the reader started after the
room was registered, prefill restarted, the feed dropped posts, prefill is an older build) is looked up
directly (:func:`fetch_digests`). When a publishing prefill's digest does not arrive within the wait, decode
reports that it timed out (the guard then fails closed). Prefill's board and the bodies of its routes are in
:mod:`.digest_board`; this module holds the clients (publisher, direct query, feed reader). It knows no SGLang
names.
"""

from __future__ import annotations

import http.client
import json
import logging
import queue
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

from sglang_harden.compat import signing
from sglang_harden.compat.digest_board import PublishedShard

logger = logging.getLogger("sglang_harden")

DIGEST_PATH = "/sglang_harden/digest"
DIGESTS_PATH = "/sglang_harden/digests"
FEED_PATH = "/sglang_harden/digest_feed"
HTTP_TIMEOUT_S = 2.0
WAIT_POLL_S = 0.002
FEED_WAIT_MS = 1000  # how long one feed query may wait for a post (the reader re-asks; it is not a deadline)
FEED_RETRY_S = 0.05
FEED_IDLE_EXIT_S = 30.0  # a reader with no room to watch for this long stops (a new room restarts it)
PENDING_TTL_S = 900.0  # a watched room nobody committed (aborted, lost) is forgotten after this
PUBLISH_QUEUE_CAP = 4096
POST_RETRY_S = 8.0  # a queued post that did not reach the board is tried again for this long (decode waits 5 s)
POST_RETRY_PAUSE_S = 0.2


class DigestPublisher:
    """Posts shard digests to the local bootstrap server over a kept-alive connection (:data:`CONNECTIONS`).

    :meth:`publish` only queues the post: a background thread sends the posts in order, so the scheduler's
    send does not wait for an HTTP round trip; a post the board did not take (unreachable, 5xx) is tried again
    for :data:`POST_RETRY_S`. Decode waits (bounded) for a digest that is not there yet, so
    a post that lands after the KV is still in time; one that never lands makes decode refuse the request.
    The queue is bounded: past :data:`PUBLISH_QUEUE_CAP` posts waiting, a post is dropped and logged.
    :meth:`publish_now` posts on the caller's thread and returns whether the board took it."""

    def __init__(self, base_url: str, timeout_s: float = HTTP_TIMEOUT_S) -> None:
        self._addr = urllib.parse.urlsplit(base_url).netloc
        self._base_url = base_url.rstrip("/")
        self._timeout_s = timeout_s
        self._queue: queue.Queue[tuple[PublishedShard | Callable[[], PublishedShard], float]] = queue.Queue(
            PUBLISH_QUEUE_CAP)
        self._sender: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def publish(self, shard: PublishedShard) -> None:
        self._enqueue(shard, shard.room)

    def publish_when_ready(self, make: Callable[[], PublishedShard]) -> None:
        """Queue a shard that ``make`` produces on the sender's thread (it may wait there, e.g. for a digest still
        being computed on the GPU; the caller never does)."""
        self._enqueue(make, "(not yet known)")

    def _enqueue(self, item: PublishedShard | Callable[[], PublishedShard], room: object) -> None:
        self._ensure_sender()
        try:
            self._queue.put_nowait((item, time.monotonic()))
        except queue.Full:
            logger.error("sglang-harden: %d digests are waiting to be posted to %s; dropped the digest of room %s"
                         " (decode will refuse that request)", PUBLISH_QUEUE_CAP, self._base_url, room)

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued post was sent (tests, shutdown); whether that happened in time."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._queue.unfinished_tasks

    def publish_now(self, shard: PublishedShard) -> bool:
        return self._post(shard, final=True) == 200

    def _post(self, shard: PublishedShard, final: bool) -> int | None:
        """One PUT: the board's HTTP status, or None when it was not reached. Logged as an error when ``final``
        (no retry follows) and the board did not take it."""
        body = json.dumps({"room": shard.room, "rank": shard.rank, "values": list(shard.values)}).encode()
        try:
            status, _ = CONNECTIONS.request("PUT", self._addr, DIGEST_PATH, self._timeout_s, body)
        except (http.client.HTTPException, OSError) as exc:
            if final:
                logger.error("sglang-harden: publishing the digest of room %s to %s failed: %s",
                             shard.room, self._base_url, exc)
            return None
        if status != 200 and final:
            logger.error("sglang-harden: the bootstrap server refused the digest of room %s: HTTP %s",
                         shard.room, status)
        return status

    def _post_until_taken(self, shard: PublishedShard, queued_at: float) -> None:
        """Post, and post again after a transport failure or a 5xx (a busy or restarting board) until the board
        takes it or :data:`POST_RETRY_S` have passed since the post was queued: decode is still waiting for it
        (up to ``checksum_wait_ms`` after its transfer ended), and a lost post makes decode refuse the request."""
        while True:
            last_try = time.monotonic() + POST_RETRY_PAUSE_S >= queued_at + POST_RETRY_S
            status = self._post(shard, final=last_try)
            if (status is not None and status < 500) or last_try:
                return
            time.sleep(POST_RETRY_PAUSE_S)

    def _ensure_sender(self) -> None:
        if self._sender is not None:
            return
        with self._start_lock:
            if self._sender is None:
                self._sender = threading.Thread(target=self._send_forever, name="sglang-harden-digest-post",
                                                daemon=True)
                self._sender.start()

    def _send_forever(self) -> None:
        while True:
            item, queued_at = self._queue.get()
            try:
                self._post_until_taken(item() if callable(item) else item, queued_at)
            except Exception as exc:  # noqa: BLE001 - the sender thread must survive a shard that failed
                logger.error("sglang-harden: a digest could not be posted: %r", exc)
            finally:
                self._queue.task_done()


@dataclass(frozen=True)
class Fetched:
    """What decode learned about a room: the shards found, and why there are none when there are none."""

    shards: dict[int, tuple[int, ...]]
    reason: str = ""
    timed_out: bool = False  # the wait ran out: prefill did not answer, or not with every digest needed
    via: str = "board"  # "feed": decode's feed reader had them; "board": queried from prefill's board


CONNECTIONS = signing.CLIENT  # kept-alive, signed (channels/http_client.py)


def fetch_digests(
    addr: str, room: int, wait_s: float, enough: Callable[[dict[int, tuple[int, ...]]], bool]
) -> Fetched:
    """The room's shards from prefill's bootstrap server at ``addr``, waiting up to ``wait_s`` until they are
    ``enough`` (cover the heads the caller holds). Returns at once when that prefill does not publish digests;
    a query that fails is retried until the wait is over, then reported as timed out."""
    deadline = time.monotonic() + wait_s
    path = f"{DIGESTS_PATH}?room={room}"
    shards: dict[int, tuple[int, ...]] = {}
    answered, failure = False, ""
    while True:
        left = deadline - time.monotonic()
        data = None
        try:
            status, body = CONNECTIONS.request("GET", addr, path, min(HTTP_TIMEOUT_S, max(left, 0.05)))
            if status == 404:
                return Fetched({}, "prefill's bootstrap server has no digest route (prefill not hardened)")
            if status == 200:
                data = json.loads(body)
                if not isinstance(data, dict):
                    data, failure = None, f"answered a JSON {type(data).__name__}"
            else:
                failure = f"HTTP {status}"
        except (http.client.HTTPException, OSError, ValueError) as exc:
            failure = repr(exc)
        if data is not None:
            if not data.get("publishing", False):
                return Fetched({}, "prefill does not publish digests (its checksum guard is off)")
            shards = {int(rank): tuple(int(v) for v in values) for rank, values in data.get("shards", {}).items()}
            if enough(shards):
                return Fetched(shards)
            answered, failure = True, ""
        if time.monotonic() >= deadline:
            return Fetched(shards, _why_not(addr, room, wait_s, shards, answered, failure), timed_out=True)
        time.sleep(WAIT_POLL_S)


def _why_not(
    addr: str, room: int, wait_s: float, shards: dict[int, tuple[int, ...]], answered: bool, failure: str
) -> str:
    if not answered:
        return f"prefill's bootstrap server at {addr} did not answer the digest query within {wait_s} s: {failure}"
    what = "not every rank's digest" if shards else "no digest"
    last = f" (last query failed: {failure})" if failure else ""
    return f"prefill published {what} for room {room} within {wait_s} s{last}"


@dataclass
class _Watched:
    receiver: weakref.ref[object]
    since: float
    covered: bool  # the reader had a cursor when the room was registered: every post for it comes through
    shards: dict[int, tuple[int, ...]] = field(default_factory=dict)


@dataclass
class _Prefill:
    """What decode's reader of one prefill node's feed knows."""

    rooms: dict[int, _Watched] = field(default_factory=dict)
    epoch: str = ""
    cursor: int | None = None
    usable: bool = True  # False: no feed route (older or unhardened prefill) or not publishing
    running: bool = False


class DigestFeed:
    """Decode's reader of prefill digest feeds: one thread per prefill bootstrap address with rooms to watch.

    :meth:`watch` registers a room when its receiver is made; the address's thread asks that prefill's feed
    for every post after its cursor (each query waits up to :data:`FEED_WAIT_MS` for one) and keeps the shards
    of watched rooms. :meth:`take` hands a room's shards to the commit, waiting a bounded time, or returns
    ``None`` when the feed cannot vouch that it saw every post for the room; the caller then asks the board
    directly. Rooms are forgotten when taken, when their receiver is gone, or after :data:`PENDING_TTL_S`."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._prefills: dict[str, _Prefill] = {}

    def watch(self, addr: str, room: int, receiver: object) -> None:
        with self._cond:
            prefill = self._prefills.setdefault(addr, _Prefill())
            covered = prefill.cursor is not None and prefill.usable
            prefill.rooms[room] = _Watched(weakref.ref(receiver), time.monotonic(), covered)
            if not prefill.running and prefill.usable:  # a prefill without a feed is not asked again per room
                prefill.running = True
                threading.Thread(target=self._read, args=(addr, prefill), name="sglang-harden-digest-feed",
                                 daemon=True).start()

    def take(
        self, addr: str, room: int, wait_s: float, enough: Callable[[dict[int, tuple[int, ...]]], bool]
    ) -> Fetched | None:
        deadline = time.monotonic() + wait_s
        with self._cond:
            prefill = self._prefills.get(addr)
            watched = prefill.rooms.get(room) if prefill is not None else None
            if prefill is None or watched is None:
                return None
            try:
                while watched.covered and prefill.usable:
                    if enough(watched.shards):
                        return Fetched(dict(watched.shards), via="feed")
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    self._cond.wait(left)
                return None
            finally:
                prefill.rooms.pop(room, None)

    def _read(self, addr: str, prefill: _Prefill) -> None:
        idle_since = time.monotonic()
        while True:
            with self._cond:
                self._forget_stale(prefill)
                if prefill.rooms:
                    idle_since = time.monotonic()
                if not prefill.usable or time.monotonic() - idle_since > FEED_IDLE_EXIT_S:
                    prefill.running = False
                    return
                since, epoch = prefill.cursor, prefill.epoch
            answer = self._ask(addr, since, epoch)
            if answer is None:
                time.sleep(FEED_RETRY_S)
            elif not self._take_answer(prefill, answer):
                time.sleep(FEED_RETRY_S)

    def _forget_stale(self, prefill: _Prefill) -> None:
        now = time.monotonic()
        for room, watched in list(prefill.rooms.items()):
            if watched.receiver() is None or now - watched.since > PENDING_TTL_S:
                del prefill.rooms[room]

    def _ask(self, addr: str, since: int | None, epoch: str) -> dict[str, object] | None:
        wait_ms = FEED_WAIT_MS if since is not None else 0
        path = f"{FEED_PATH}?since={'' if since is None else since}&epoch={epoch}&wait_ms={wait_ms}"
        try:
            status, body = CONNECTIONS.request("GET", addr, path, wait_ms / 1000 + HTTP_TIMEOUT_S)
        except (http.client.HTTPException, OSError) as exc:
            logger.debug("sglang-harden: digest feed of %s did not answer: %r", addr, exc)
            return None
        if status == 404:
            return {"publishing": False}
        try:
            data = json.loads(body) if status == 200 else None
        except ValueError:
            data = None
        return data if isinstance(data, dict) else None

    def _take_answer(self, prefill: _Prefill, answer: dict[str, object]) -> bool:
        """Apply one feed answer; False when it brought nothing new (the reader then pauses briefly)."""
        with self._cond:
            if not answer.get("publishing", False):
                prefill.usable = False
                self._cond.notify_all()
                return False
            cursor, epoch, posts = answer.get("cursor"), answer.get("epoch"), answer.get("posts")
            if not isinstance(cursor, int) or not isinstance(epoch, str) or not isinstance(posts, list):
                return False
            if not answer.get("complete", False):
                for watched in prefill.rooms.values():
                    watched.covered = False
            fresh = cursor != prefill.cursor or epoch != prefill.epoch
            prefill.cursor, prefill.epoch = cursor, epoch
            for room, rank, values in posts:
                watched = prefill.rooms.get(room)
                if watched is not None:
                    watched.shards[int(rank)] = tuple(int(v) for v in values)
            self._cond.notify_all()
            return fresh


def receive_digests(
    feed: DigestFeed | None, addr: str, room: int, wait_s: float,
    enough: Callable[[dict[int, tuple[int, ...]]], bool],
) -> Fetched:
    """The room's shards for decode's commit: from the feed when it vouches for the room, else (or when the
    feed's wait ran out) straight from prefill's board for whatever is left of ``wait_s``."""
    deadline = time.monotonic() + wait_s
    fetched = feed.take(addr, room, wait_s, enough) if feed is not None else None
    if fetched is not None:
        return fetched
    return fetch_digests(addr, room, max(deadline - time.monotonic(), 0.0), enough)
