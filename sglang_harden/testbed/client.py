"""HTTP helpers: plain ``/generate``, a paired PD request sent directly, and one through sglang-router.

Stdlib only (the tests' python need not have ``requests``), through the operator tools' HTTP client. A paired
request posts the same body, plus ``bootstrap_host``/``bootstrap_port``/``bootstrap_room``, to the prefill and the
decode server concurrently, which is what the router does.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from sglang_harden.tools import _http

ANSWER_CAP_BYTES = 64 << 20


@dataclass
class GenResult:
    """One HTTP answer from ``/generate``."""

    status: int
    body: Any
    elapsed_s: float
    output_ids: list[int] | None = None
    logprobs: list[float] | None = None
    # per output position: token id -> logprob of the most likely tokens (asked with ``top_logprobs``)
    top_logprobs: list[dict[int, float]] | None = None
    text: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == 200

    def error_message(self) -> str:
        if isinstance(self.body, dict):
            err = self.body.get("error")
            if isinstance(err, dict):
                return str(err.get("message", err))
            if err is not None:
                return str(err)
            if "detail" in self.body:  # FastAPI's answer to an HTTPException (0.4.x: a scheduler abort of 500/503)
                return str(self.body["detail"])
            return str(self.body.get("message", ""))
        return str(self.body)[:500]

    def summary(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "output_ids": self.output_ids,
            "logprobs": self.logprobs,
            "elapsed_s": round(self.elapsed_s, 3),
            "error": None if self.ok else self.error_message(),
            "prompt_tokens": self.meta.get("prompt_tokens"),
            "completion_tokens": self.meta.get("completion_tokens"),
        }


@dataclass
class PairResult:
    """The two halves of one PD request sent directly to both servers."""

    prefill: GenResult
    decode: GenResult
    room: int


def http_json(method: str, url: str, body: Any = None, timeout: float = 60.0) -> tuple[int, Any]:
    """One JSON exchange through the operator tools' client (``tools/_http.py``: a total deadline, a capped answer);
    a transport failure is a ``ConnectionError`` naming it (callers treat it as any ``OSError``)."""
    try:
        response = _http.request(method, url, body, timeout_s=timeout, max_bytes=ANSWER_CAP_BYTES)
    except _http.HttpError as exc:
        raise ConnectionError(str(exc)) from None
    return response.status, _decode(response.body)


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


def _parse(status: int, body: Any, elapsed: float) -> GenResult:
    result = GenResult(status=status, body=body, elapsed_s=elapsed)
    if isinstance(body, list) and body:
        body = body[0]
    if status != 200 or not isinstance(body, dict):
        return result
    meta = body.get("meta_info") or {}
    result.meta = meta
    result.text = body.get("text")
    token_logprobs = meta.get("output_token_logprobs")
    if token_logprobs:
        result.logprobs = [float(item[0]) if item[0] is not None else float("nan") for item in token_logprobs]
        result.output_ids = [int(item[1]) for item in token_logprobs]
    if body.get("output_ids") is not None:
        result.output_ids = [int(x) for x in body["output_ids"]]
    top = meta.get("output_top_logprobs")
    if top:
        result.top_logprobs = [{int(item[1]): float(item[0]) for item in position or () if item[0] is not None}
                               for position in top]
    return result


def greedy_difference(x: GenResult, y: GenResult, tie: float) -> str | None:
    """Why two greedy answers to one prompt differ beyond floating-point ties, or None. Up to their first differing
    token both must agree; there, each answer's own top logprobs must hold both tokens within ``tie`` of each other
    (a near-tie that kernel or batch order may break either way); past it the two continuations legitimately
    differ and are not compared."""
    ids_x, ids_y = x.output_ids or [], y.output_ids or []
    if len(ids_x) != len(ids_y):
        return f"{len(ids_x)} vs {len(ids_y)} output tokens"
    for k, (tx, ty) in enumerate(zip(ids_x, ids_y, strict=True)):
        if tx != ty:
            return _unless_tied(k, tx, ty, x, y, tie)
    return None


def _unless_tied(k: int, tx: int, ty: int, x: GenResult, y: GenResult, tie: float) -> str | None:
    for name, res in (("first", x), ("second", y)):
        top = (res.top_logprobs or [])[k] if k < len(res.top_logprobs or []) else {}
        if tx not in top or ty not in top:
            return f"token {k}: {tx} vs {ty}; the {name} answer's top logprobs {top} do not hold both"
        if abs(top[tx] - top[ty]) > tie:
            return f"token {k}: {tx} vs {ty}; the {name} answer ranks them {top[tx]:.6f} vs {top[ty]:.6f}"
    return None


def generate(url: str, body: dict[str, Any], timeout: float = 120.0) -> GenResult:
    """POST ``body`` to ``url``/generate."""
    start = time.monotonic()
    try:
        status, answer = http_json("POST", url.rstrip("/") + "/generate", body, timeout)
    except OSError as exc:
        return GenResult(status=-1, body={"error": repr(exc)}, elapsed_s=time.monotonic() - start)
    return _parse(status, answer, time.monotonic() - start)


def greedy_body(
    input_ids: list[int], max_new_tokens: int, rid: str | None = None, logprobs: bool = True
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "input_ids": list(input_ids),
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
        "return_logprob": logprobs,
    }
    if rid is not None:
        body["rid"] = rid
    return body


def pd_generate(
    prefill_url: str,
    decode_url: str,
    bootstrap_port: int,
    body: dict[str, Any],
    room: int | None = None,
    bootstrap_host: str = "127.0.0.1",
    timeout: float = 120.0,
    prefill_body: dict[str, Any] | None = None,
) -> PairResult:
    """Send one PD request directly: the same body with bootstrap fields to both servers concurrently.

    ``prefill_body`` (optional) replaces what prefill gets, to model two nodes that see one request
    differently (e.g. a prompt that only prefill's front door refuses)."""
    room = random.randrange(2**62) if room is None else room
    boot = {"bootstrap_host": bootstrap_host, "bootstrap_port": bootstrap_port, "bootstrap_room": room}
    paired = {**body, **boot}
    to_prefill = paired if prefill_body is None else {**prefill_body, **boot}
    with ThreadPoolExecutor(max_workers=2) as pool:
        fut_p = pool.submit(generate, prefill_url, to_prefill, timeout)
        fut_d = pool.submit(generate, decode_url, paired, timeout)
        return PairResult(prefill=fut_p.result(), decode=fut_d.result(), room=room)


def router_generate(router_url: str, body: dict[str, Any], timeout: float = 120.0) -> GenResult:
    """Send a request through sglang-router (it adds the bootstrap fields itself)."""
    return generate(router_url, body, timeout)
