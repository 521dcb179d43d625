"""How ``probe`` talks to a target: SGLang-native ``/generate``, OpenAI ``/v1/completions``, or a direct PD
pair (the same body posted to prefill and decode with a shared ``bootstrap_room``, as sglang-router does).

Every call is greedy (temperature 0) and bounded by the caller's timeout; the result says what a *client*
would have seen (for a pair: decode's answer when decode answered 200, otherwise the first refusal).
"""

from __future__ import annotations

import random
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

from sglang_harden.tools._http import HttpError, Response, request, split_url

MAX_BYTES = 4 << 20


@dataclass
class Outcome:
    """One generation as the client saw it."""

    status: int | None  # None: no HTTP answer (refused connection, timeout)
    text: str | None = None
    output_ids: list[int] | None = None
    error: str | None = None
    elapsed_s: float = 0.0
    detail: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300 and self.error is None

    @property
    def refused(self) -> bool:
        return self.status is not None and 400 <= self.status < 500

    @property
    def signature(self) -> tuple[str | None, tuple[int, ...] | None]:
        return self.text, tuple(self.output_ids) if self.output_ids is not None else None

    def summary(self, width: int = 60) -> str:
        if self.status is None:
            return f"no answer ({self.error})"
        if not self.ok:
            return f"HTTP {self.status}: {(self.error or '')[:width]}"
        shown = repr((self.text or "")[:width]) if self.text is not None else str(self.output_ids)[:width]
        return f"HTTP {self.status}, {self.completion_tokens or '?'} tokens: {shown}"


@dataclass
class Prompt:
    ids: list[int] | None = None
    text: str | None = None


class Endpoint:
    name = "endpoint"

    def urls(self) -> list[str]:
        raise NotImplementedError

    def generate(self, prompt: Prompt, max_new_tokens: int, timeout_s: float) -> Outcome:
        raise NotImplementedError


def _error_message(body: Any, resp: Response) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            err = err.get("message")
        msg = err or body.get("message") or body.get("detail")
        if msg:
            return str(msg)[:300]
    return resp.text(300) or f"HTTP {resp.status} with an empty body"


def _safe_json(resp: Response) -> Any:
    try:
        return resp.json()
    except HttpError:
        return None


def _ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value
    return None


class NativeEndpoint(Endpoint):
    name = "sglang-native /generate"

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def urls(self) -> list[str]:
        return [self.url]

    def body(self, prompt: Prompt, max_new_tokens: int, rid: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens},
            "rid": rid,
        }
        if prompt.ids is not None:
            body["input_ids"] = prompt.ids
        else:
            body["text"] = prompt.text
        return body

    def generate(self, prompt: Prompt, max_new_tokens: int, timeout_s: float) -> Outcome:
        body = self.body(prompt, max_new_tokens, uuid.uuid4().hex)
        return post_generate(self.url + "/generate", body, timeout_s)


def post_generate(url: str, body: dict[str, Any], timeout_s: float) -> Outcome:
    try:
        resp = request("POST", url, body, timeout_s=timeout_s, max_bytes=MAX_BYTES)
    except HttpError as exc:
        return Outcome(None, error=str(exc))
    return parse_native(resp)


def parse_native(resp: Response) -> Outcome:
    body = _safe_json(resp)
    if not resp.ok:
        return Outcome(resp.status, error=_error_message(body, resp), elapsed_s=resp.elapsed_s)
    if isinstance(body, list) and body:
        body = body[0]
    if not isinstance(body, dict) or not isinstance(body.get("text", ""), str):
        return Outcome(resp.status, error=f"unexpected /generate body: {resp.text(120)!r}", elapsed_s=resp.elapsed_s)
    meta = body.get("meta_info") if isinstance(body.get("meta_info"), dict) else {}
    finish = meta.get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "abort":
        status = finish.get("status_code") if isinstance(finish.get("status_code"), int) else 500
        return Outcome(
            resp.status,
            error=f"aborted in a 2xx body: {finish.get('message')}",
            elapsed_s=resp.elapsed_s,
            detail=f"abort status {status}",
        )
    return Outcome(
        resp.status,
        text=body.get("text"),
        output_ids=_ids(body.get("output_ids")) or _ids(meta.get("output_ids")),
        elapsed_s=resp.elapsed_s,
        prompt_tokens=meta.get("prompt_tokens") if isinstance(meta.get("prompt_tokens"), int) else None,
        completion_tokens=meta.get("completion_tokens") if isinstance(meta.get("completion_tokens"), int) else None,
    )


class OpenAIEndpoint(Endpoint):
    name = "OpenAI /v1/completions"

    def __init__(self, url: str, model: str) -> None:
        self.url = url.rstrip("/")
        self.model = model

    def urls(self) -> list[str]:
        return [self.url]

    def generate(self, prompt: Prompt, max_new_tokens: int, timeout_s: float) -> Outcome:
        body = {
            "model": self.model,
            "prompt": prompt.ids if prompt.ids is not None else prompt.text,
            "max_tokens": max_new_tokens,
            "temperature": 0.0,
        }
        try:
            resp = request("POST", self.url + "/v1/completions", body, timeout_s=timeout_s, max_bytes=MAX_BYTES)
        except HttpError as exc:
            return Outcome(None, error=str(exc))
        data = _safe_json(resp)
        if not resp.ok:
            return Outcome(resp.status, error=_error_message(data, resp), elapsed_s=resp.elapsed_s)
        choices = data.get("choices") if isinstance(data, dict) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            return Outcome(resp.status, error=f"unexpected completions body: {resp.text(120)!r}")
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
        text = choices[0].get("text")
        return Outcome(
            resp.status,
            text=text if isinstance(text, str) else None,
            elapsed_s=resp.elapsed_s,
            prompt_tokens=usage.get("prompt_tokens") if isinstance(usage.get("prompt_tokens"), int) else None,
            completion_tokens=usage.get("completion_tokens")
            if isinstance(usage.get("completion_tokens"), int)
            else None,
        )


@dataclass
class _Half:
    outcome: Outcome | None = None
    done: threading.Event = field(default_factory=threading.Event)


class PairEndpoint(Endpoint):
    """A prefill and a decode server without a router: post the same body to both, like the router does."""

    name = "direct PD pair (/generate on both)"

    def __init__(self, prefill: str, decode: str, bootstrap_port: int, abort_grace_s: float = 5.0) -> None:
        self.prefill = prefill.rstrip("/")
        self.decode = decode.rstrip("/")
        self.bootstrap_port = bootstrap_port
        self.bootstrap_host = split_url(self.prefill)[1]
        self.abort_grace_s = abort_grace_s
        self._native = NativeEndpoint(self.decode)

    def urls(self) -> list[str]:
        return [self.prefill, self.decode]

    def generate(self, prompt: Prompt, max_new_tokens: int, timeout_s: float) -> Outcome:
        rid = uuid.uuid4().hex
        body = self._native.body(prompt, max_new_tokens, rid)
        body.update(
            bootstrap_host=self.bootstrap_host,
            bootstrap_port=self.bootstrap_port,
            bootstrap_room=random.getrandbits(63),
        )
        halves = {"prefill": _Half(), "decode": _Half()}
        for role, url in (("prefill", self.prefill), ("decode", self.decode)):
            thread = threading.Thread(target=self._run, args=(url, body, timeout_s, halves[role]), daemon=True)
            thread.start()
        halves["prefill"].done.wait(timeout_s + 1)
        pre = halves["prefill"].outcome
        if pre is not None and not pre.ok:
            # Prefill refused. Give decode a grace period (a leaking decode answers 200 anyway), then abort it
            # so that it does not hold its reservation until its own waiting timeout.
            if not halves["decode"].done.wait(min(self.abort_grace_s, timeout_s)):
                self._abort(rid, timeout_s)
                halves["decode"].done.wait(min(self.abort_grace_s, timeout_s))
        else:
            halves["decode"].done.wait(timeout_s + 1)
        dec = halves["decode"].outcome or Outcome(None, error=f"{self.decode}: no answer")
        pre = pre or Outcome(None, error=f"{self.prefill}: no answer")
        return self._client_view(pre, dec)

    @staticmethod
    def _run(url: str, body: dict[str, Any], timeout_s: float, half: _Half) -> None:
        try:
            half.outcome = post_generate(url + "/generate", body, timeout_s)
        finally:
            half.done.set()

    def _abort(self, rid: str, timeout_s: float) -> None:
        try:
            request("POST", self.decode + "/abort_request", {"rid": rid}, timeout_s=min(5.0, timeout_s))
        except HttpError:
            pass

    @staticmethod
    def _client_view(pre: Outcome, dec: Outcome) -> Outcome:
        detail = f"prefill {pre.status or 'no answer'} / decode {dec.status or 'no answer'}"
        if dec.ok:
            dec.detail = detail
            return dec
        chosen = pre if not pre.ok else dec
        return Outcome(chosen.status, error=chosen.error, elapsed_s=max(pre.elapsed_s, dec.elapsed_s), detail=detail)
