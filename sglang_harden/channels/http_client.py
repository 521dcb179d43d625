"""One HTTP client for the side channels between PD nodes (abort notices, KV digests): a kept-alive connection per
(thread, address), a timeout on every exchange, a cap on the answer's size, and bounded retries for a post that must
land. Every request carries the headers ``sign`` gives it (the control-plane token). Standard library only."""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Callable

Sign = Callable[[str, str, "bytes | None"], dict[str, str]]
MAX_ANSWER_BYTES = 1 << 22


class SideChannelClient:
    """``request`` is one round trip on an open socket where one is kept for this thread and address (a kept
    connection the server closed is replaced once); ``request_until`` retries a bounded number of times."""

    def __init__(self, sign: Sign | None = None, max_answer_bytes: int = MAX_ANSWER_BYTES,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self._sign = sign
        self._max_answer_bytes = max_answer_bytes
        self._sleep = sleep
        self._local = threading.local()

    def request(self, method: str, addr: str, path: str, timeout_s: float,
                body: bytes | None = None) -> tuple[int, bytes]:
        """(HTTP status, answer); raises ``http.client.HTTPException`` or ``OSError`` when no answer came."""
        connections: dict[str, http.client.HTTPConnection] = self._local.__dict__.setdefault("connections", {})
        while True:
            connection = connections.get(addr)
            fresh = connection is None
            if connection is None:
                connection = connections[addr] = http.client.HTTPConnection(addr, timeout=timeout_s)
            try:
                if connection.sock is not None:
                    connection.sock.settimeout(timeout_s)
                return self._exchange(connection, method, path, body)
            except (http.client.HTTPException, OSError):
                connections.pop(addr, None)
                connection.close()
                if fresh:
                    raise

    def request_until(self, method: str, addr: str, path: str, timeout_s: float, body: bytes | None = None, *,
                      attempts: int, pause_s: float,
                      done: Callable[[int], bool] = lambda status: status == 200) -> tuple[int | None, str]:
        """Up to ``attempts`` exchanges, the n-th failure followed by ``n * pause_s`` of sleep, until ``done``
        accepts a status: (the last status, None when never answered; the last transport failure, "" if none)."""
        status: int | None = None
        failure = ""
        for attempt in range(1, attempts + 1):
            try:
                status, _ = self.request(method, addr, path, timeout_s, body)
                failure = ""
            except (http.client.HTTPException, OSError) as exc:
                status, failure = None, repr(exc)
            if status is not None and done(status):
                break
            if attempt < attempts:
                self._sleep(pause_s * attempt)
        return status, failure

    def _exchange(self, connection: http.client.HTTPConnection, method: str, path: str,
                  body: bytes | None) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        if self._sign is not None:
            headers.update(self._sign(method, path, body))
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        if int(response.getheader("Content-Length") or 0) > self._max_answer_bytes:
            raise http.client.HTTPException(f"answer longer than {self._max_answer_bytes} bytes")
        answer = response.read(self._max_answer_bytes + 1)
        if len(answer) > self._max_answer_bytes:
            raise http.client.HTTPException(f"answer longer than {self._max_answer_bytes} bytes")
        if response.will_close:
            connection.close()
        return response.status, answer
