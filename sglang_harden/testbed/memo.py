"""One expensive run (a pair started, rounds played) per key for all the tests of an e2e module."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any


def run_once(runs: dict[Hashable, dict[str, Any]], key: Hashable, make: Callable[[], Any]) -> Any:
    """``make()``'s result for ``key``, made the first time it is asked for. A failure is remembered and raised
    again for every test that needs that run: a failed server start is never retried."""
    if key not in runs:
        try:
            runs[key] = {"result": make()}
        except Exception as exc:  # noqa: BLE001 - re-raised for every test that needs this run
            runs[key] = {"error": exc}
    if "error" in runs[key]:
        raise runs[key]["error"]
    return runs[key]["result"]
