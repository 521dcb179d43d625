#!/usr/bin/env python3
"""Soak a real CPU PD topology, vanilla vs hardened: ``python scripts/soak.py --pin 0.5.19 --compare --json``.

Same as ``sglang-harden soak`` (see ``sglang_harden/tools/soak.py`` for the options and exit codes).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_harden.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["soak", *sys.argv[1:]]))
