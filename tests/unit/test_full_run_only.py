"""``ci/pins.toml [ci].full_run_only``: every entry names an e2e module and one of its collected cases, and CI skips
exactly those (the full run, ``SGLANG_HARDEN_FULL_RUN=1``, runs them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

from sglang_harden.testbed.envs import full_run_only

ROOT = Path(__file__).resolve().parents[2]


def _pytest(*args: str) -> str:
    env = {**os.environ, "SGLANG_HARDEN_FULL_RUN": "0", "SGLANG_HARDEN_PINS": "all"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "e2e", "-rs", *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return out.stdout


def test_each_full_run_case_is_a_collected_case_that_ci_skips_saying_why(tmp_path: Path) -> None:
    entries = full_run_only()
    assert entries, "nothing left to the full run: drop this test with the list"
    modules = sorted({f"tests/e2e/{entry.partition('::')[0]}" for entry in entries})
    collected = _pytest("--collect-only", *modules).splitlines()
    chosen = []
    for entry in entries:
        module, _, case = entry.partition("::")
        listed = [line.strip() for line in collected
                  if line.startswith(f"tests/e2e/{module}::") and f"[{case}]" in line]
        assert listed, entry
        chosen.append(listed[0])
    report = tmp_path / "full_run_only.xml"
    ran = _pytest(f"--junitxml={report}", *chosen)  # the skip mark is applied at collection: no server starts
    assert f"{len(chosen)} skipped" in ran and " passed" not in ran and " failed" not in ran, ran
    skipped = {f"{case.get('classname')}::{case.get('name')}": case.find("skipped")
               for case in ElementTree.parse(report).getroot().iter("testcase")}
    for node_id in chosen:
        module, _, name = node_id.partition("::")
        reason = skipped.get(f"{module.removesuffix('.py').replace('/', '.')}::{name}")
        assert reason is not None and "left to the full run" in str(reason.get("message")), (node_id, ran)
