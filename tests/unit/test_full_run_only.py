"""``ci/pins.toml [ci].full_run_only``: every entry names an e2e module and one of its collected cases, and CI skips
exactly those (the full run, ``SGLANG_HARDEN_FULL_RUN=1``, runs them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sglang_harden.testbed.envs import full_run_only

ROOT = Path(__file__).resolve().parents[2]


def _pytest(*args: str) -> str:
    env = {**os.environ, "SGLANG_HARDEN_FULL_RUN": "0", "SGLANG_HARDEN_PINS": "all"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "e2e", "-rs", *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return out.stdout


def test_each_full_run_case_is_a_collected_case_that_ci_skips_saying_why() -> None:
    entries = full_run_only()
    assert entries, "nothing left to the full run: drop this test with the list"
    for entry in entries:
        module, _, case = entry.partition("::")
        path = f"tests/e2e/{module}"
        listed = [line for line in _pytest("--collect-only", path).splitlines() if f"[{case}]" in line]
        assert listed, entry
        ran = _pytest(listed[0].strip())  # the skip mark is applied at collection: no server starts
        assert "1 skipped" in ran and "left to the full run" in ran, ran
