"""One HTTP client for the side channels between PD nodes (abort notices, KV digests): a kept-alive connection per
(thread, address), a timeout on every exchange, a cap on the answer's size, and bounded retries for a post that must
land. Every request carries the headers its signer gives it (the control-plane token), and an answer the signer
refuses (not signed by the server for that request) is no answer: ``http.client.HTTPException``. Standard library
only."""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

MAX_ANSWER_BYTES = 1 << 22


class UntrustedAnswer(http.client.HTTPException):
    """An answer the signer refused: no answer (and not retried on another connection: the server did answer)."""


class Signer(Protocol):
    """The control plane's authentication as a client sees it (``compat/signing_client.Signer``)."""

    def headers(self, method: str, authority: str, target: str, body: bytes | str | None) -> dict[str, str]: ...

    def answer_refusal(self, sent: Mapping[str, str], status: int, answer: Mapping[str, Any], body: bytes,
                       **about: object) -> str | None: ...


class SideChannelClient:
    """``request`` is one round trip on an open socket where one is kept for this thread and address (a kept
    connection the server closed is replaced once); ``request_until`` retries a bounded number of times."""

    def __init__(self, signer: Signer | None = None, max_answer_bytes: int = MAX_ANSWER_BYTES,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self._signer = signer
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
                return self._exchange(connection, method, addr, path, body)
            except UntrustedAnswer:
                raise
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

    def _exchange(self, connection: http.client.HTTPConnection, method: str, addr: str, path: str,
                  body: bytes | None) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        sent = self._signer.headers(method, addr, path, body) if self._signer is not None else {}
        headers.update(sent)
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        if int(response.getheader("Content-Length") or 0) > self._max_answer_bytes:
            raise http.client.HTTPException(f"answer longer than {self._max_answer_bytes} bytes")
        answer = response.read(self._max_answer_bytes + 1)
        if len(answer) > self._max_answer_bytes:
            raise http.client.HTTPException(f"answer longer than {self._max_answer_bytes} bytes")
        if response.will_close:
            connection.close()
        if self._signer is not None:
            refusal = self._signer.answer_refusal(sent, response.status, response.msg, answer, url=f"{addr}{path}")
            if refusal is not None:
                raise UntrustedAnswer(f"untrusted answer from {addr}: {refusal}")
        return response.status, answer
