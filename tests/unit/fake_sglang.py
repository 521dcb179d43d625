"""Tiny local HTTP fakes for the operator tools' tests: well-behaved SGLang look-alikes and hostile servers.

Each fake binds 127.0.0.1 on a free port in a daemon thread and is stopped by its context manager.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Route = Callable[["Handler", Any], None]


class Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, *args: object) -> None:  # keep test output clean
        pass

    def _dispatch(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        route = self.server.routes.get((method, self.path)) or self.server.routes.get(("*", self.path))
        if any(self.headers.get(name) != value for name, value in self.server.required_headers.items()):
            self.reply(401, {"error": "Unauthorized"})  # what SGLang's --api-key check answers
            return
        if route is None:
            self.reply(404, {"detail": "Not Found"})
            return
        try:
            route(self, body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def do_GET(self) -> None:  # noqa: N802
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def reply(self, status: int, payload: Any, content_type: str = "application/json") -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    routes: dict[tuple[str, str], Route]
    required_headers: dict[str, str]


@contextlib.contextmanager
def serve(routes: dict[tuple[str, str], Route], required_headers: dict[str, str] | None = None,
          tls: ssl.SSLContext | None = None) -> Iterator[str]:
    """The fake's base URL; every request without ``required_headers`` gets 401; ``tls``: served over https."""
    server = _Server(("127.0.0.1", 0), Handler)
    server.routes = routes
    server.required_headers = dict(required_headers or {})
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------- hostile


def raw(data: bytes) -> Route:
    def route(h: Handler, _: Any) -> None:
        h.wfile.write(data)
        h.wfile.flush()
        h.close_connection = True

    return route


def json_route(payload: Any, status: int = 200) -> Route:
    return lambda h, _: h.reply(status, payload)


def bytes_route(data: bytes, status: int = 200, content_type: str = "application/json") -> Route:
    return lambda h, _: h.reply(status, data, content_type)


def slow(seconds: float, payload: Any = None) -> Route:
    def route(h: Handler, _: Any) -> None:
        time.sleep(seconds)
        h.reply(200, payload if payload is not None else {})

    return route


def drip(interval: float = 0.1, total_s: float = 30.0) -> Route:
    """Headers at once, then one body byte per ``interval``, never finishing within the test."""

    def route(h: Handler, _: Any) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", "1000000")
        h.end_headers()
        end = time.monotonic() + total_s
        while time.monotonic() < end:
            h.wfile.write(b" ")
            h.wfile.flush()
            time.sleep(interval)

    return route


def endless(chunk: int = 1 << 16, total: int = 1 << 30) -> Route:
    """A body without Content-Length that streams ``total`` bytes (until the client hangs up)."""

    def route(h: Handler, _: Any) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.end_headers()
        block = b"[" + b"1," * (chunk // 2)
        sent = 0
        while sent < total:
            h.wfile.write(block)
            sent += len(block)
        h.close_connection = True

    return route


# ---------------------------------------------------------------------------------------------- sglang-like


@dataclass
class FakeNode:
    """An SGLang-ish server: limits, role, guard counters, and optionally the incident's leak."""

    role: str = "null"
    context_length: int = 512
    pool_tokens: int = 600
    max_req_input_len: int | None = None
    leaky: bool = False  # answer oversized prompts with 200 and output derived from the previous request
    guards: dict[str, dict[str, int]] = field(default_factory=dict)
    metrics: bool = True
    echo: bool = False  # a model that repeats codes it is asked to
    last_ids: list[int] = field(default_factory=list)
    requests: int = 0

    @property
    def limit(self) -> int:
        if self.max_req_input_len is not None:
            return self.max_req_input_len
        return min(self.context_length - 1, self.pool_tokens - 1) - 5

    def server_info(self) -> dict[str, Any]:
        return {
            "disaggregation_mode": self.role,
            "context_length": self.context_length,
            "max_total_num_tokens": self.pool_tokens,
            "max_req_input_len": self.limit,
            "disaggregation_transfer_backend": "mooncake",
            "internal_states": [{"memory_usage": {"token_capacity": self.pool_tokens}}],
            "version": "fake",
        }

    def metrics_text(self) -> str:
        lines = [
            "# HELP sglang_harden_guard_decisions_total sglang-harden guard decisions",
            "# TYPE sglang_harden_guard_decisions_total counter",
        ]
        for guard, decisions in self.guards.items():
            for decision, n in decisions.items():
                lines.append(f'sglang_harden_guard_decisions_total{{decision="{decision}",guard="{guard}"}} {n}.0')
        lines.append('sglang:num_requests_total{model_name="tiny"} 3.0')
        return "\n".join(lines) + "\n"

    def generate(self, body: Any) -> tuple[int, Any]:
        self.requests += 1
        if not isinstance(body, dict):
            return 400, {"error": {"message": "bad body"}}
        ids = body.get("input_ids")
        text = body.get("text")
        if ids is None and text is not None:
            return 200, self._text_answer(text)
        ids = list(ids or [])
        n_new = int((body.get("sampling_params") or {}).get("max_new_tokens", 16))
        if len(ids) >= self.limit:  # SGLang: validate_input_length refuses len >= max_req_input_len
            if not self.leaky:
                msg = f"Input length ({len(ids)} tokens) exceeds the maximum allowed length ({self.limit} tokens)."
                return 400, {"error": {"message": msg}}
            source = self.last_ids or [0]
        else:
            source = ids
        self.last_ids = ids
        out = [(sum(source) * 31 + 7 * i + source[i % len(source)]) % 500 for i in range(n_new)]
        return 200, {
            "text": " ".join(map(str, out)),
            "output_ids": out,
            "meta_info": {"prompt_tokens": len(ids), "completion_tokens": n_new},
        }

    def _text_answer(self, text: str) -> dict[str, Any]:
        codes = [w.strip(".:\n") for w in text.split() if w.startswith("QX")]
        answer = " ".join(codes) if self.echo else "the the the"
        return {"text": answer, "meta_info": {"prompt_tokens": len(text), "completion_tokens": 4}}

    def routes(self) -> dict[tuple[str, str], Route]:
        def gen(h: Handler, body: Any) -> None:
            status, payload = self.generate(body)
            h.reply(status, payload)

        routes: dict[tuple[str, str], Route] = {
            ("GET", "/server_info"): lambda h, _: h.reply(200, self.server_info()),
            ("GET", "/v1/models"): lambda h, _: h.reply(
                200, {"object": "list", "data": [{"id": "tiny", "max_model_len": self.context_length}]}
            ),
            ("POST", "/generate"): gen,
            ("POST", "/abort_request"): lambda h, _: h.reply(200, {}),
        }
        if self.metrics:
            routes[("GET", "/metrics")] = lambda h, _: h.reply(200, self.metrics_text().encode(), "text/plain")
        return routes
