"""The operator tools run as an operator runs them (``python -m sglang_harden <tool> ... --json`` in a subprocess),
for the e2e tests that point them at testbed pairs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from sglang_harden.testbed.envs import REPO_ROOT


def run_tool(*args: str, timeout: float = 600) -> tuple[int, dict[str, Any]]:
    """Exit code and the parsed ``--json`` output; a traceback on stderr is a failure of the tool itself."""
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_harden", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    if "Traceback" in proc.stderr:
        raise AssertionError(proc.stderr[-3000:])
    return proc.returncode, json.loads(proc.stdout)


def pair_args(pair: Any) -> list[str]:
    """``--prefill/--decode/--bootstrap-port`` of a testbed pair, as ``probe`` takes them."""
    return ["--prefill", pair.prefill.url, "--decode", pair.decode.url,
            "--bootstrap-port", str(pair.prefill.bootstrap_port)]


def probe_results(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``probe``'s results by probe name."""
    return {r["probe"]: r for r in data["results"]}
