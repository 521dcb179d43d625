"""Run from ``sglang_harden_startup.pth`` at every interpreter start in an environment with sglang-harden.

It does nothing unless ``SGLANG_HARDEN_ACTIVATE=1`` (set by ``python -m sglang_harden.launch_server`` and
inherited by every process SGLang spawns). Then it registers the guards' import hooks, which costs no SGLang
import; the hooks install themselves as SGLang's modules load. This is how pins without SGLang's plugin API
get the guards into their spawned scheduler processes.
"""

from __future__ import annotations

import os
import sys


def maybe_install() -> None:
    if os.environ.get("SGLANG_HARDEN_ACTIVATE", "").strip() != "1":
        return
    try:
        from sglang_harden.compat import activate

        activate(source="startup-hook")
    except Exception as exc:  # noqa: BLE001 - a half-armed process must not run
        print(f"sglang-harden: refusing to run unguarded: {exc}", file=sys.stderr)
        os._exit(78)
