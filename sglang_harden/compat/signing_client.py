"""A ``requests`` module that signs every request it sends, for SGLang's bootstrap client code.

SGLang's bootstrap client (``common/conn.py``) reaches the bootstrap server through the module-level name
``requests``; replacing that name by :class:`SigningRequests` signs its calls and its sessions without touching
them. ``headers(method, target, body)`` gives the token header for one request (``{}``: send unsigned).

This file needs nothing but the standard library: the backport series embed everything below the marker line in
their ``pd_auth.py`` (``patches/_source/gen.py``), so the plugin and a patched tree sign the same way, from one
source (a unit test regenerates the series and fails on any drift).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

# ---- embedded in the backport series from here on

HeaderSource = Callable[[str, str, Any], dict[str, str]]


class _SignEach:
    """``requests``' auth hook: signs each prepared request once its URL and body are final."""

    def __init__(self, headers: HeaderSource) -> None:
        self._headers = headers

    def __call__(self, prepared: Any) -> Any:
        prepared.headers.update(self._headers(prepared.method or "GET", prepared.path_url, prepared.body))
        return prepared


class SigningRequests(ModuleType):
    """The ``requests`` module as the bootstrap client sees it: every request and session it makes signs."""

    signs_requests = True

    def __init__(self, real: ModuleType, headers: HeaderSource) -> None:
        super().__init__(real.__name__)
        self._real = real
        self._auth = _SignEach(headers)

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
