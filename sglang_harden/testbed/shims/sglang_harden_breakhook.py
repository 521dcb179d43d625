"""Stand-in for an SGLang build whose code moved (test-only): one hook target removed or its signature changed.

``SGLANG_HARDEN_TESTBED_BREAK_HOOK="<remove|resign>:<module>:<qualname>"``, e.g.
``remove:sglang.srt.disaggregation.decode:DecodePreallocQueue.add``:

- ``remove``: the attribute is deleted from its class (or module);
- ``resign``: it is replaced by a function that does the same but whose second parameter has another name.

The change is made as the module finishes importing, before any other post-import callback (sglang-harden's
hooks among them) sees the module, so the guards meet it the way they would meet a real SGLang build with that
change. Used by ``tests/e2e/test_fail_closed_e2e.py``: the server must refuse to start.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Any

from sglang_harden._importhook import when_imported

ENV = "SGLANG_HARDEN_TESTBED_BREAK_HOOK"
ACTIONS = ("remove", "resign")


def parse(raw: str) -> tuple[str, str, str]:
    action, module, qualname = raw.split(":")
    if action not in ACTIONS:
        raise ValueError(f"{ENV}: action {action!r} is not one of {ACTIONS}")
    return action, module, qualname


def _resigned(original: Any) -> Any:
    def moved(self: Any, renamed_by_upstream: Any, *args: Any, **kwargs: Any) -> Any:
        return original(self, renamed_by_upstream, *args, **kwargs)

    # named like the original but without ``__wrapped__``: inspect.signature would follow it to the old signature
    moved.__module__, moved.__name__, moved.__qualname__ = original.__module__, original.__name__, original.__qualname__
    return moved


def _break(action: str, qualname: str, module: ModuleType) -> None:
    *path, attr = qualname.split(".")
    owner: Any = module
    for part in path:
        owner = getattr(owner, part)
    if action == "remove":
        delattr(owner, attr)
    else:
        setattr(owner, attr, _resigned(getattr(owner, attr)))


def install() -> None:
    action, module, qualname = parse(os.environ[ENV])
    when_imported(module, functools.partial(_break, action, qualname), first=True)
