"""A ``requests`` module that signs every request it sends and checks every answer, for SGLang's bootstrap client.

SGLang's bootstrap client (``common/conn.py``) reaches the bootstrap server through the module-level name
``requests``; replacing that name by :class:`SigningRequests` signs its calls and its sessions without touching
them. The token covers the authority the URL names (``host:port``). An answer the server did not sign for the
request (below 400) reaches SGLang's code as a 502 answer, which every caller already treats as a failed exchange
(in log mode the signer lets it through and only reports it).

Only requests to SGLang's bootstrap routes (``BOOTSTRAP_PATHS``) are signed and their answers checked: the same
``requests`` also carries the ``/health`` heartbeat and, on 0.5.23, the retraction's ``/generate`` to prefill's
HTTP API, whose answers no bootstrap server signs. A bootstrap route a later release adds goes out unsigned and
the bootstrap server refuses it (401): closed, and visible in the in-process tests of a new pin.

The plugin (``control_auth``) and the backport series (``pd_auth`` bundles this module) use the same code; standard
library only.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

from sglang_harden.compat.control_keys import ControlKeys, CurrentSigner

# SGLang's bootstrap routes but /health (every release from 0.4.9 to 0.5.23 has a subset of these)
BOOTSTRAP_PATHS = frozenset({"/route", "/register_dp_rank", "/query_dp_ranks"})


def url_authority(url: str) -> str:
    """The ``host:port`` a URL names (without any user info), as the client addresses it."""
    return urlsplit(url).netloc.rpartition("@")[2]


class _SignEach:
    """``requests``' auth hook: signs each prepared request once its URL and body are final, and holds the answer
    to that request's token."""

    def __init__(self, signer: ControlKeys | CurrentSigner, real: ModuleType) -> None:
        self._signer = signer
        self._real = real

    def __call__(self, prepared: Any) -> Any:
        target = prepared.path_url
        if urlsplit(target).path not in BOOTSTRAP_PATHS:
            return prepared
        sent = self._signer.headers(prepared.method or "GET", url_authority(prepared.url), target, prepared.body)
        if sent:
            prepared.headers.update(sent)
            prepared.register_hook("response", lambda answer, **_: self._checked(sent, answer))
        return prepared

    def _checked(self, sent: dict[str, str], answer: Any) -> Any:
        refusal = self._signer.answer_refusal(sent, answer.status_code, answer.headers, answer.content,
                                              url=answer.url)
        if refusal is None:
            return answer
        untrusted = self._real.models.Response()
        untrusted.status_code, untrusted.reason = 502, "Untrusted Answer"
        untrusted._content = f"sglang-harden: {refusal}\n".encode()
        untrusted.encoding, untrusted.url, untrusted.request = "utf-8", answer.url, answer.request
        return untrusted


class SigningRequests(ModuleType):
    """The ``requests`` module as the bootstrap client sees it: every request and session it makes signs."""

    signs_requests = True

    def __init__(self, real: ModuleType, signer: ControlKeys | CurrentSigner) -> None:
        super().__init__(real.__name__)
        self._real = real
        self._auth = _SignEach(signer, real)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def request(self, method: str, url: str, **kwargs: Any) -> Any:
        kwargs.setdefault("auth", self._auth)
        return self._real.request(method, url, **kwargs)

    def get(self, url: str, params: Any = None, **kwargs: Any) -> Any:
        return self.request("GET", url, params=params, **kwargs)

    def put(self, url: str, data: Any = None, **kwargs: Any) -> Any:
        return self.request("PUT", url, data=data, **kwargs)

    def post(self, url: str, data: Any = None, json: Any = None, **kwargs: Any) -> Any:
        return self.request("POST", url, data=data, json=json, **kwargs)

    def delete(self, url: str, **kwargs: Any) -> Any:
        return self.request("DELETE", url, **kwargs)

    def Session(self) -> Any:  # noqa: N802 - the name SGLang calls
        session = self._real.Session()
        session.auth = self._auth
        return session
