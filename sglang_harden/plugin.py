"""SGLang plugin entry point (``sglang.srt.plugins``): installing sglang-harden arms it.

SGLang's ``load_plugins()`` logs and swallows a plugin's exceptions. A guard that failed to arm must not
serve silently, so a refusal here leaves the process with SystemExit, which that handler does not catch.
Set ``SGLANG_HARDEN_ACTIVATE=0`` (or leave the plugin out of ``SGLANG_PLUGINS``) to run SGLang unguarded.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger("sglang_harden")


def load() -> None:
    if os.environ.get("SGLANG_HARDEN_ACTIVATE", "").strip() == "0":
        logger.warning("sglang-harden installed but disabled (SGLANG_HARDEN_ACTIVATE=0)")
        return
    from sglang_harden.compat import activate
    from sglang_harden.compat.runtime import HardenRefusal

    try:
        activate(source="plugin")
    except HardenRefusal as exc:
        print(str(exc), file=sys.stderr)
        raise SystemExit(78) from exc
