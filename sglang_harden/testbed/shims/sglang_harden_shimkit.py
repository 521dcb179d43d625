"""One helper the test-only shims share: wrap methods of an SGLang class once per process."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def wrap_methods_once(cls: type, marker: str, wrappers: Mapping[str, Callable[[Any], Any]]) -> None:
    """``cls.<name> = wrapper(cls.<name>)`` for each entry, unless ``marker`` says this class was done."""
    if getattr(cls, marker, False):
        return
    for name, wrap in wrappers.items():
        setattr(cls, name, wrap(getattr(cls, name)))
    setattr(cls, marker, True)
