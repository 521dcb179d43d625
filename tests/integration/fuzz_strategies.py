"""Hypothesis strategies for fuzzing a bootstrap server's control routes (the plugin's and the patch series'):
bodies of any shape, queries, and tokens that look almost right."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

HEADER = "X-SGLang-Harden-Auth"

SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.floats(allow_nan=False)
           | st.text(max_size=20))
JSONISH = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                                            max_size=6), max_leaves=12)
# a route's own field names with wrong types: one level deep (a nested JSONISH per field drew ~4x slower, and
# nesting is already in the JSONISH bodies)
FIELD_VALUES = SCALARS | st.lists(SCALARS, max_size=4) | st.dictionaries(st.text(max_size=12), SCALARS, max_size=4)
QUERIES = st.one_of(st.just(""), st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789=&,-_", max_size=40).map(
    lambda q: "?" + q))
TOKENS = st.one_of(st.none(), st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=300),
                   st.builds(lambda ts, n, m: f"sgh1.{ts}.{n}.{m}", st.integers(-5, 2**40),
                             st.text(alphabet="0123456789abcdef", min_size=32, max_size=32),
                             st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)),
                   st.builds(lambda ts, n, d, m: f"sgh2.{ts}.{n}.{d}.{m}",
                             st.one_of(st.integers(-5, 2**40).map(str), st.just(str(int(time.time()))),
                                       st.text(alphabet="0123456789²³¹¼", min_size=1, max_size=12)),
                             st.text(alphabet="0123456789abcdef", min_size=32, max_size=32),
                             st.text(alphabet="0123456789abcdef", min_size=64, max_size=64),
                             st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)))


def bodies(field_names: Iterable[str]) -> st.SearchStrategy[bytes]:
    """Raw bytes, any JSON, and JSON objects made of the given field names with values of any type."""
    fields = {name: FIELD_VALUES for name in field_names}
    return st.one_of(st.binary(max_size=2048), JSONISH.map(lambda v: json.dumps(v).encode()),
                     st.fixed_dictionaries({}, optional=fields).map(lambda v: json.dumps(v).encode()))


Send = Callable[[str, str, bytes, dict[str, str]], Any]  # (method, target, body, headers) -> a requests answer


def fuzz_unsigned(send: Send, method: str, path: str, body_strategy: st.SearchStrategy[bytes], examples: int,
                  state: Callable[[], object]) -> None:
    """Requests to ``path`` with any body, query, verb and a missing or made-up token: each must get 401, the
    server's ``state()`` must not change, and the server must stay healthy."""
    before = state()

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=body_strategy, query=QUERIES, token=TOKENS, verb=st.sampled_from([method, "POST", "DELETE", "PATCH"]))
    def one(body: bytes, query: str, token: str | None, verb: str) -> None:
        answer = send(verb, path + query, body, {} if token is None else {HEADER: token})
        assert answer.status_code == 401, (answer.status_code, answer.text[:200])

    one()
    assert state() == before, "refused requests changed the server's state"
    assert send("GET", "/health", b"", {}).status_code == 200


def fuzz_signed(send: Send, sign: Callable[[str, str, bytes], dict[str, str]], method: str, path: str,
                body_strategy: st.SearchStrategy[bytes], examples: int) -> None:
    """Validly signed requests to ``path`` with bodies of any shape (a bug, or a compromised node): a 4xx or a
    2xx, never a 5xx."""

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(body=body_strategy, query=QUERIES)
    def one(body: bytes, query: str) -> None:
        target = path + query
        answer = send(method, target, body, sign(method, target, body))
        assert answer.status_code < 500, (answer.status_code, answer.text[:200])

    one()
