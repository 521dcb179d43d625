"""The bounded HTTP client: every hostile answer becomes one clear HttpError, in bounded time and memory."""

from __future__ import annotations

import time

import pytest
from fake_sglang import bytes_route, drip, endless, free_port, json_route, raw, serve, slow

from sglang_harden.tools._http import HttpError, get_json, request


def test_good_json() -> None:
    with serve({("GET", "/x"): json_route({"a": 1})}) as url:
        assert get_json(url + "/x", timeout_s=2) == {"a": 1}


def test_bad_json_is_a_clear_error() -> None:
    with serve({("GET", "/x"): bytes_route(b"{not json")}) as url:
        with pytest.raises(HttpError, match="invalid JSON"):
            get_json(url + "/x", timeout_s=2)


def test_non_2xx_names_status() -> None:
    with serve({("GET", "/x"): json_route({"detail": "nope"}, status=503)}) as url:
        with pytest.raises(HttpError, match="HTTP 503"):
            get_json(url + "/x", timeout_s=2)


def test_connection_refused() -> None:
    with pytest.raises(HttpError, match="connection refused"):
        request("GET", f"http://127.0.0.1:{free_port()}/x", timeout_s=2)


def test_slow_response_times_out_in_bounded_time() -> None:
    with serve({("GET", "/x"): slow(5)}) as url:
        start = time.monotonic()
        with pytest.raises(HttpError, match="no complete response within 0.5s"):
            request("GET", url + "/x", timeout_s=0.5)
        assert time.monotonic() - start < 2.0


def test_dripping_body_cannot_outlive_the_deadline() -> None:
    with serve({("GET", "/x"): drip(interval=0.05, total_s=10)}) as url:
        start = time.monotonic()
        with pytest.raises(HttpError, match="no complete response"):
            request("GET", url + "/x", timeout_s=1.0)
        assert time.monotonic() - start < 2.5


def test_declared_huge_body_refused_before_reading() -> None:
    with serve({("GET", "/x"): bytes_route(b"x" * 5000)}) as url:
        with pytest.raises(HttpError, match="exceeds the 1000-byte cap"):
            request("GET", url + "/x", timeout_s=2, max_bytes=1000)


def test_undeclared_endless_body_is_capped() -> None:
    with serve({("GET", "/x"): endless()}) as url:
        start = time.monotonic()
        with pytest.raises(HttpError, match="exceeds the 1048576-byte cap"):
            request("GET", url + "/x", timeout_s=10, max_bytes=1 << 20)
        assert time.monotonic() - start < 5


def test_garbage_instead_of_http() -> None:
    with serve({("GET", "/x"): raw(b"SSH-2.0-OpenSSH\r\n\r\n")}) as url:
        with pytest.raises(HttpError, match="malformed HTTP response|closed the connection"):
            request("GET", url + "/x", timeout_s=2)


def test_not_a_url() -> None:
    with pytest.raises(HttpError, match="not an http"):
        request("GET", "ftp://x/y")
