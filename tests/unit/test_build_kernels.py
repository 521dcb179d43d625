"""``sglang-harden build-kernels`` (an image's build step) and the server side of it: a library built into the
folder beforehand is loaded where no compiler is on ``PATH``; without it, the same process falls back and says
why. Each case runs in a fresh Python (the kernels modules keep what they loaded for the process's lifetime).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STATUS = ("from sglang_harden.kernels import digest_native, ledger_native\n"
          "import json\n"
          "print(json.dumps({'digest': digest_native.native_status(), 'ledger': ledger_native.native_status()}))\n")


def _python(args: list[str], home: Path, no_compiler: bool = False) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SGLANG_HARDEN_HOME": str(home), "PYTHONPATH": str(REPO)}
    if no_compiler:
        env.update({"PATH": str(home / "empty-bin"), "CC": "/nonexistent-cc"})
    return subprocess.run([sys.executable, *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=300,
                          check=False)


def test_libraries_built_beforehand_load_without_a_compiler(tmp_path: Path) -> None:
    before = _python(["-c", STATUS], tmp_path, no_compiler=True)
    assert before.returncode == 0, before.stderr
    for built, why in json.loads(before.stdout).values():
        assert not built and "no C compiler" in why, before.stdout

    step = _python(["-m", "sglang_harden.cli", "build-kernels", "--json"], tmp_path)
    report = json.loads(step.stdout)
    assert step.returncode == 0 and report["exit_code"] == 0, step.stdout + step.stderr
    assert report["folder"] == str(tmp_path / "kernels")
    assert all(library["built"] for library in report["libraries"].values()), report
    assert len(list((tmp_path / "kernels").glob("*.so"))) == 2

    after = _python(["-c", STATUS], tmp_path, no_compiler=True)
    assert after.returncode == 0, after.stderr
    for built, why in json.loads(after.stdout).values():
        assert built and why.startswith("loaded the library built before"), after.stdout


def test_build_kernels_without_a_compiler_fails_and_says_what_runs_instead(tmp_path: Path) -> None:
    step = _python(["-m", "sglang_harden.cli", "build-kernels"], tmp_path, no_compiler=True)
    assert step.returncode == 1, step.stdout + step.stderr
    assert step.stdout.count("NOT BUILT") == 2 and "torch/numpy paths" in step.stdout, step.stdout
