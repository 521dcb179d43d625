"""The digest side channel: prefill publishes each request's per-rank KV digests where decode can read them.

The checksum guard needs, at decode's commit, the digests prefill computed over what it sent. They travel
through prefill's bootstrap server (the one decode already talks to), next to the abort routes:

- ``PUT /sglang_harden/digest``             a prefill rank posts ``{room, rank, values}`` (packed shard)
- ``GET /sglang_harden/digests?room=R``     decode reads every rank's shard for the room, and whether this
                                            prefill publishes digests at all (``publishing``)

Prefill posts synchronously, before the final KV send is issued, so a digest is on the board before decode can
see the transfer finish; decode still waits a bounded time at its commit (an HTTP answer can be slow on a busy
host) and, when a publishing prefill's digest does not arrive within it, reports that it timed out (the guard
then fails closed). This module knows no SGLang names.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger("sglang_harden")

DIGEST_PATH = "/sglang_harden/digest"
DIGESTS_PATH = "/sglang_harden/digests"
BOARD_CAPACITY = 16384
BOARD_TTL_S = 900.0
HTTP_TIMEOUT_S = 2.0
MAX_VALUES = 4096
MAX_RANKS = 1024
WAIT_POLL_S = 0.002


@dataclass(frozen=True)
class PublishedShard:
    room: int
    rank: int
    values: tuple[int, ...]


class DigestBoard:
    """Per room, the packed shard digest of each prefill rank; bounded in count and time (oldest first)."""

    def __init__(self, capacity: int = BOARD_CAPACITY, ttl_s: float = BOARD_TTL_S) -> None:
        self._capacity = capacity
        self._ttl_s = ttl_s
        self._rooms: OrderedDict[int, tuple[float, dict[int, tuple[int, ...]]]] = OrderedDict()
        self._lock = threading.Lock()

    def post(self, shard: PublishedShard) -> None:
        now = time.monotonic()
        with self._lock:
            stamp, ranks = self._rooms.pop(shard.room, (now, {}))
            ranks[shard.rank] = shard.values
            self._rooms[shard.room] = (stamp, ranks)
            while len(self._rooms) > self._capacity:
                self._rooms.popitem(last=False)

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


BOARD = DigestBoard()


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


class DigestPublisher:
    """Posts shard digests to the local bootstrap server on the caller's thread, over a kept-alive connection
    (:data:`CONNECTIONS`), so a digest is on the board before the send it vouches for is issued. Returns
    whether the board took it."""

    def __init__(self, base_url: str, timeout_s: float = HTTP_TIMEOUT_S) -> None:
        self._addr = urllib.parse.urlsplit(base_url).netloc
        self._base_url = base_url.rstrip("/")
        self._timeout_s = timeout_s

    def publish(self, shard: PublishedShard) -> bool:
        body = json.dumps({"room": shard.room, "rank": shard.rank, "values": list(shard.values)}).encode()
        try:
            status, _ = CONNECTIONS.request("PUT", self._addr, DIGEST_PATH, self._timeout_s, body)
        except (http.client.HTTPException, OSError) as exc:
            logger.error("sglang-harden: publishing the digest of room %s to %s failed: %s",
                         shard.room, self._base_url, exc)
            return False
        if status != 200:
            logger.error("sglang-harden: the bootstrap server refused the digest of room %s: HTTP %s",
                         shard.room, status)
        return status == 200


@dataclass(frozen=True)
class Fetched:
    """What decode learned about a room: the shards found, and why there are none when there are none."""

    shards: dict[int, tuple[int, ...]]
    reason: str = ""
    timed_out: bool = False  # the wait ran out: prefill did not answer, or not with every digest needed


class KeptAlive:
    """One kept-alive HTTP connection per (thread, address) for the digest routes (prefill's posts, decode's
    queries): a request then costs one round trip on an open socket, not a TCP handshake. A kept connection the
    server closed is replaced once."""

    MAX_BODY = 1 << 22

    def __init__(self) -> None:
        self._local = threading.local()

    def request(
        self, method: str, addr: str, path: str, timeout_s: float, body: bytes | None = None
    ) -> tuple[int, bytes]:
        connections: dict[str, http.client.HTTPConnection] = self._local.__dict__.setdefault("connections", {})
        while True:
            connection = connections.get(addr)
            fresh = connection is None
            if connection is None:
                connection = connections[addr] = http.client.HTTPConnection(addr, timeout=timeout_s)
            elif connection.sock is not None:
                connection.sock.settimeout(timeout_s)
            try:
                return self._exchange(connection, method, path, body)
            except (http.client.HTTPException, OSError):
                connections.pop(addr, None)
                connection.close()
                if fresh:
                    raise

    def _exchange(
        self, connection: http.client.HTTPConnection, method: str, path: str, body: bytes | None
    ) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        if int(response.getheader("Content-Length") or 0) > self.MAX_BODY:
            raise http.client.HTTPException(f"answer longer than {self.MAX_BODY} bytes")
        answer = response.read()
        if response.will_close:
            connection.close()
        return response.status, answer


CONNECTIONS = KeptAlive()


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
