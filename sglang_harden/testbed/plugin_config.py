"""The plugin's runtime configuration for in-process tests: a secret file in force for a while, then the previous
configuration back (the control-plane secret cache and the decision counters reset around it)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from sglang_harden import events
from sglang_harden.compat import control_auth
from sglang_harden.compat.runtime import RUNTIME
from sglang_harden.config import HardenConfig


def write_secret(path: Path, secret: str) -> Path:
    path.write_text(secret + "\n")
    path.chmod(0o600)
    return path


@contextlib.contextmanager
def secret_in_force(secret_file: Path) -> Iterator[Path]:
    """The plugin configured as a node started with ``secret_file`` (every other setting at its default)."""
    saved = RUNTIME.config
    RUNTIME.config = HardenConfig(bootstrap_secret_file=str(secret_file))
    control_auth._cache.clear()
    events.reset_for_tests()
    try:
        yield secret_file
    finally:
        RUNTIME.config = saved
        control_auth._cache.clear()
