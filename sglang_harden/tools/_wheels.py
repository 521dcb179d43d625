"""SGLang release sources on disk, for tools that read SGLang's code without installing or importing it.

A release's tree comes from, in order: a testbed pin venv (``$SGLANG_HARDEN_HOME/venvs/<version>``), an
unpacked wheel cached under ``$SGLANG_HARDEN_HOME/wheel-src/<version>``, or ``pip download --no-deps
sglang==<version>`` (the package index pip is configured for), of which only ``sglang/**/*.py`` is unpacked.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from sglang_harden.testbed.envs import harden_home, venv_dir

RELEASE_RE = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:\.post(\d+))?$")


class ReleaseUnavailable(RuntimeError):
    """No tree for a release here, and the download failed (offline, no such release)."""


def release_key(version: str) -> tuple[int, int, int, int]:
    """Order of final releases (``0.4.9 < 0.4.9.post1 < 0.4.10``); ValueError for anything else (rc, dev)."""
    match = RELEASE_RE.match(version)
    if match is None:
        raise ValueError(f"not a final SGLang release number: {version!r}")
    major, minor, micro, post = match.groups()
    return int(major), int(minor), int(micro), int(post) if post is not None else -1


def index_releases(timeout_s: float = 120.0) -> list[str]:
    """Final releases of ``sglang`` on the package index, oldest first (``pip index versions``)."""
    cmd = [sys.executable, "-m", "pip", "index", "versions", "sglang"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ReleaseUnavailable(f"could not list SGLang releases: {exc}") from exc
    found = re.search(r"^Available versions:\s*(.+)$", proc.stdout, re.M)
    if proc.returncode != 0 or found is None:
        raise ReleaseUnavailable(f"could not list SGLang releases: {(proc.stderr or proc.stdout)[-300:]}")
    versions = [v.strip() for v in found.group(1).split(",")]
    return sorted((v for v in versions if RELEASE_RE.match(v)), key=release_key)


def release_tree(version: str, download: bool = True) -> Path:
    """The directory that contains ``sglang/`` for ``version`` (see the module docstring for where from)."""
    installed = next((venv_dir(version) / "lib").glob("python3*/site-packages"), None)
    if installed is not None and (installed / "sglang").is_dir() and (
            installed / f"sglang-{version}.dist-info").is_dir():
        return installed
    unpacked = harden_home() / "wheel-src" / version
    if (unpacked / "sglang" / "srt").is_dir():
        return unpacked
    if not download:
        raise ReleaseUnavailable(f"sglang {version}: no venv or unpacked wheel under {harden_home()}, and downloads "
                                 "are off")
    return _unpack(_download(version), unpacked)


def _download(version: str) -> Path:
    cache = harden_home() / "wheel-cache"
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if wheels:
        return wheels[-1]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q",
           f"sglang=={version}", "-d", str(cache)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ReleaseUnavailable(f"sglang {version}: download failed: {exc}") from exc
    wheels = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise ReleaseUnavailable(f"sglang {version}: download failed: {proc.stderr[-300:]}")
    return wheels[-1]


def _unpack(wheel: Path, dest: Path) -> Path:
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(partial, [n for n in zf.namelist() if n.startswith("sglang/") and n.endswith(".py")])
    shutil.rmtree(dest, ignore_errors=True)
    partial.rename(dest)
    return dest
