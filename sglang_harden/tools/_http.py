"""A small, bounded HTTP client on the standard library only (the tools must run in any environment).

Every call has a hard wall-clock deadline (a timer shuts the socket down, so a server that drips bytes
cannot hold us), a cap on the bytes read, and turns every failure into :class:`HttpError` with a message
meant for a person: connection refused, timed out, body too large, malformed HTTP, invalid JSON.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_BYTES = 8 << 20
_CHUNK = 64 << 10


class HttpError(Exception):
    """A request that did not produce a usable response; ``str()`` is the user-facing reason."""


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    content_type: str
    elapsed_s: float

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    def text(self, limit: int = 300) -> str:
        text = self.body.decode("utf-8", errors="replace").strip()
        return text if len(text) <= limit else text[:limit] + "…"

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except (ValueError, RecursionError) as exc:
            raise HttpError(f"invalid JSON in HTTP {self.status} response ({exc}): {self.text(120)!r}") from None


def split_url(url: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, base path) of ``url``; raises HttpError for anything but http(s)://host[:port]."""
    parsed = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise HttpError(f"not an http(s) URL: {url!r}")
    try:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
    except ValueError:
        raise HttpError(f"bad port in URL {url!r}") from None
    return parsed.scheme, parsed.hostname, port, parsed.path.rstrip("/")


def request(
    method: str,
    url: str,
    payload: Any = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Response:
    """One HTTP exchange bounded by ``timeout_s`` in total and ``max_bytes`` of body."""
    scheme, host, port, base = split_url(url)
    path = base or "/"
    query = urllib.parse.urlsplit(url).query
    if query:
        path = f"{path}?{query}"
    body = None if payload is None else json.dumps(payload).encode()
    conn_cls = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
    conn = conn_cls(host, port, timeout=timeout_s)
    expired = threading.Event()
    held: list[socket.socket] = []
    timer = threading.Timer(timeout_s, _kill, args=(held, expired))
    timer.daemon = True
    start = time.monotonic()
    timer.start()
    try:
        headers = {"Accept": "application/json", "Connection": "close"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        conn.connect()
        if conn.sock is not None:
            held.append(conn.sock)  # the response keeps using it after conn.sock is dropped
        if expired.is_set():
            raise TimeoutError
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        data = _read_capped(resp, max_bytes, url)
        if expired.is_set():
            raise TimeoutError
        return Response(resp.status, data, resp.getheader("Content-Type") or "", time.monotonic() - start)
    except HttpError:
        raise
    except Exception as exc:  # noqa: BLE001 - every transport failure becomes one clear message
        raise HttpError(_describe(exc, url, timeout_s, expired.is_set())) from None
    finally:
        timer.cancel()
        conn.close()


def _kill(held: list[socket.socket], expired: threading.Event) -> None:
    expired.set()
    for sock in held:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _read_capped(resp: http.client.HTTPResponse, max_bytes: int, url: str) -> bytes:
    declared = resp.getheader("Content-Length")
    if declared and declared.isdigit() and int(declared) > max_bytes:
        raise HttpError(f"{url}: response body of {int(declared)} bytes exceeds the {max_bytes}-byte cap")
    chunks: list[bytes] = []
    total = 0
    while True:
        chunk = resp.read1(_CHUNK)
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > max_bytes:
            raise HttpError(f"{url}: response body exceeds the {max_bytes}-byte cap")
        chunks.append(chunk)


def _describe(exc: BaseException, url: str, timeout_s: float, expired: bool) -> str:
    if expired or isinstance(exc, TimeoutError | socket.timeout):
        return f"{url}: no complete response within {timeout_s:g}s"
    if isinstance(exc, ConnectionRefusedError):
        return f"{url}: connection refused (is the server running?)"
    if isinstance(exc, http.client.RemoteDisconnected | ConnectionResetError | BrokenPipeError):
        return f"{url}: server closed the connection without a complete response"
    if isinstance(exc, http.client.HTTPException):
        return f"{url}: malformed HTTP response ({type(exc).__name__}: {exc})"
    if isinstance(exc, socket.gaierror):
        return f"{url}: cannot resolve host ({exc})"
    return f"{url}: {type(exc).__name__}: {exc}"


def get_json(url: str, timeout_s: float = DEFAULT_TIMEOUT_S, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """GET and decode JSON; a non-2xx status is an HttpError naming the status and the start of the body."""
    resp = request("GET", url, timeout_s=timeout_s, max_bytes=max_bytes)
    if not resp.ok:
        raise HttpError(f"{url}: HTTP {resp.status}: {resp.text(120)!r}")
    return resp.json()


def join(base: str, path: str) -> str:
    return base.rstrip("/") + path
