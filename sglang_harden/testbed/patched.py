"""A pin's SGLang with its backport series applied, for servers the e2e tests start with the plugin off."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from sglang_harden.testbed.envs import require_env, venv_site_packages
from sglang_harden.testbed.procenv import CHECKOUT, SHIMS_DIR
from sglang_harden.tools import patch as patch_tool

VERSION_FILES = ("sglang/_version.py", "sglang/version.py")


def site_packages(pin: str) -> Path:
    found = venv_site_packages(Path(require_env(pin)).parent.parent)
    if not (found / "sglang").is_dir():
        raise FileNotFoundError(f"no sglang in the {pin} venv")
    return found


def copy_series_files(pin: str, src_root: Path, dest: Path) -> Path:
    """A minimal tree: the files the pin's series touches and the version files, copied from ``src_root`` (the
    directory that holds ``sglang/``)."""
    series = patch_tool.load_series(pin, patch_tool.default_patches_dir())
    for rel in {*VERSION_FILES, *(target for patch in series for target in patch.targets)}:
        if (src_root / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src_root / rel, dest / rel)
    return dest


def patched_tree(pin: str, dest: Path) -> Path:
    """A copy of the pin's installed ``sglang/`` with the pin's series applied (the plugin is not in it). The
    venv's bytecode comes along (copytree keeps the sources' mtimes, so it stays valid; Python recompiles only
    the patched files): without it each server process compiled SGLang from source at start-up (these machines
    set PYTHONDONTWRITEBYTECODE=1)."""
    shutil.copytree(site_packages(pin) / "sglang", dest / "sglang")
    report = patch_tool.apply_series(dest, pin)
    if not report.ok:
        raise RuntimeError(f"the {pin} series did not apply: {report.message}")
    if not patch_tool.verify_series(dest, pin).ok:
        raise RuntimeError(f"the {pin} series does not verify on {dest}")
    return dest


# The testbed's decode pools hold a few hundred tokens and one prompt of 300 takes three quarters of one: the default
# quarantine cap (a quarter of the pool) would answer 503 to the next request during the milliseconds a refused
# transfer's pages wait for prefill's acknowledgement. A CPU-testbed necessity; a case that tests the cap sets its own.
TESTBED_QUARANTINE_CAP_PAGES = "1000000"


def patched_env(tree: Path) -> dict[str, str]:
    """The environment of a server running ``tree``: the patched copy first, then the test-only shims and the
    checkout they import (the CUDA simulator; the plugin stays off), and the quarantine cap out of the way of the
    testbed's tiny pools (TESTBED_QUARANTINE_CAP_PAGES)."""
    return {"SGLANG_HARDEN_ACTIVATE": "0", "PYTHONPATH": os.pathsep.join(map(str, (tree, SHIMS_DIR, CHECKOUT))),
            "SGLANG_HARDEN_QUARANTINE_CAP_PAGES": TESTBED_QUARANTINE_CAP_PAGES}
