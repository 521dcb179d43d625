"""Environment of every process the testbed starts: the pin's CPU settings plus the test-only shims."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from sglang_harden.testbed.envs import PinRecipe

SHIMS_DIR = Path(__file__).resolve().parent / "shims"
# The checkout goes on PYTHONPATH after the shims, so servers run the code under test even when the copy
# installed in the pin's venv (whose .pth start-up hook and plugin entry point are still what arm it) is older.
CHECKOUT = Path(__file__).resolve().parents[2]
# Variables of the calling environment that must not leak into a pin's interpreter.
INTERPRETER_LEAKS = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTEST_CURRENT_TEST")


def testbed_env(recipe: PinRecipe, extra: Mapping[str, str] | None = None, shims: bool = True) -> dict[str, str]:
    """os.environ minus interpreter leaks, plus the pin's server env, the shims and ``extra`` (wins)."""
    env = {k: v for k, v in os.environ.items() if k not in INTERPRETER_LEAKS}
    env.update(recipe.server_env)
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["SGLANG_HARDEN_TESTBED_PIN"] = recipe.pin
    if shims:
        env["PYTHONPATH"] = f"{SHIMS_DIR}{os.pathsep}{CHECKOUT}"
        env["SGLANG_HARDEN_TESTBED_SHIMS"] = ",".join(recipe.shims)
    # Installed sglang-harden arms itself through SGLang's plugin API; a vanilla server must say no.
    env["SGLANG_HARDEN_ACTIVATE"] = "0"
    env.update(extra or {})
    return env
