"""A small, bounded HTTP client on the standard library only (the tools must run in any environment).

Every call has a hard wall-clock deadline (a timer shuts the socket down, so a server that drips bytes
cannot hold us), a cap on the bytes read, and turns every failure into :class:`HttpError` with a message
meant for a person: connection refused, timed out, body too large, malformed HTTP, invalid JSON.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import socket
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MAX_BYTES = 8 << 20
_CHUNK = 64 << 10


class HttpError(Exception):
    """A request that did not produce a usable response; ``str()`` is the user-facing reason."""


@dataclass(frozen=True)
class ClientSettings:
    """What every request of this process sends besides its own headers, and how it checks TLS (``None``: Python's
    default verification against the system's CAs)."""

    headers: tuple[tuple[str, str], ...] = ()
    ssl_context: ssl.SSLContext | None = None


_settings = ClientSettings()
_HEADER_NAME = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")


def configure(settings: ClientSettings) -> None:
    global _settings
    _settings = settings


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """The options a fleet's nodes may need: SGLang's ``--api-key``, other headers (a gateway's), TLS."""
    parser.add_argument("--api-key-file", type=_api_key_header, metavar="FILE", dest="api_key_header",
                        help="send 'Authorization: Bearer <key>' with the key in FILE (a server started with "
                             "--api-key answers 401 without it)")
    parser.add_argument("--header", type=_header, action="append", default=[], metavar="'NAME: VALUE'",
                        help="send this header with every request (repeatable)")
    tls = parser.add_mutually_exclusive_group()
    tls.add_argument("--cacert", type=_existing_file, metavar="FILE",
                     help="verify https:// servers against the CA certificates in FILE (default: the system's)")
    tls.add_argument("--insecure", action="store_true", help="do not verify https:// servers' certificates")


def settings_from_args(args: argparse.Namespace) -> ClientSettings:
    """The client settings the options ask for; ValueError (a message for a person) when they cannot be met."""
    headers = [*([args.api_key_header] if args.api_key_header else []), *args.header]
    names = [name.lower() for name, _ in headers]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"header given twice: {', '.join(repeated)} (--api-key-file sends Authorization)")
    context = None
    if args.cacert is not None:
        try:
            context = ssl.create_default_context(cafile=str(args.cacert))
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(f"--cacert {args.cacert}: not usable CA certificates ({exc})") from None
    elif args.insecure:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return ClientSettings(tuple(headers), context)


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    name, value = name.strip(), value.strip()
    if not sep or not _HEADER_NAME.match(name):
        raise argparse.ArgumentTypeError(f"expected 'NAME: VALUE', got {text!r}")
    if any(ch in value for ch in "\r\n\0"):
        raise argparse.ArgumentTypeError(f"header {name}: the value holds a line break or NUL")
    return name, value


def _api_key_header(path: str) -> tuple[str, str]:
    try:
        key = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read the API key from {path}: {exc}") from None
    if not key or any(ch in key for ch in "\r\n\0 "):
        raise argparse.ArgumentTypeError(f"{path}: the API key must be one non-empty line without spaces")
    return "Authorization", f"Bearer {key}"


def _existing_file(path: str) -> Path:
    if not Path(path).is_file():
        raise argparse.ArgumentTypeError(f"no such file: {path}")
    return Path(path)


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
    conn: http.client.HTTPConnection
    if scheme == "https":
        conn = http.client.HTTPSConnection(host, port, timeout=timeout_s, context=_settings.ssl_context)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
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
        for name, value in _settings.headers:  # the operator's header replaces ours of the same name, any case
            headers = {key: kept for key, kept in headers.items() if key.lower() != name.lower()}
            headers[name] = value
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
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"{url}: TLS certificate not verified ({exc.verify_message}; --cacert FILE names the CA)"
    return f"{url}: {type(exc).__name__}: {exc}"


def get_json(url: str, timeout_s: float = DEFAULT_TIMEOUT_S, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """GET and decode JSON; a non-2xx status is an HttpError naming the status and the start of the body."""
    resp = request("GET", url, timeout_s=timeout_s, max_bytes=max_bytes)
    if not resp.ok:
        raise HttpError(f"{url}: HTTP {resp.status}{credentials_hint(resp.status)}: {resp.text(120)!r}")
    return resp.json()


def credentials_hint(status: int) -> str:
    """What to pass when a server refuses for want of credentials (401/403), else nothing."""
    if status not in (401, 403):
        return ""
    return (" (the server wants credentials: --api-key-file FILE for a server started with --api-key, "
            "--header 'NAME: VALUE' for a gateway's)")


def join(base: str, path: str) -> str:
    return base.rstrip("/") + path
