"""SGLang plugin entry point (``sglang.srt.plugins``): installing sglang-harden arms it.

SGLang's ``load_plugins()`` logs and swallows a plugin's exceptions (``except Exception``). A guard that failed
to arm must not serve silently, so *any* failure here (a refusal, or a hook whose target is missing or changed
shape on this pin: in the scheduler process SGLang's modules are already imported when plugins load, so hooks
install at once and raise here) leaves the process with SystemExit(78), which that handler does not catch.
Set ``SGLANG_HARDEN_ACTIVATE=0`` (or leave the plugin out of ``SGLANG_PLUGINS``) to run SGLang unguarded.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("sglang_harden")
REFUSED_EXIT_CODE = 78  # EX_CONFIG, as the start-up hook


def load() -> None:
    if os.environ.get("SGLANG_HARDEN_ACTIVATE", "").strip() == "0":
        logger.warning("sglang-harden installed but disabled (SGLANG_HARDEN_ACTIVATE=0)")
        return
    try:
        from sglang_harden.compat import activate

        activate(source="plugin")
    except Exception as exc:  # noqa: BLE001 - a half-armed process must not run; SGLang would swallow it
        print(f"sglang-harden: refusing to run unguarded: {exc}", file=sys.stderr)
        raise SystemExit(REFUSED_EXIT_CODE) from exc
