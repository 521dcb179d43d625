"""SGLang release sources on disk, for tools that read SGLang's code without installing or importing it.

A release's tree comes from, in order: a testbed pin venv (``$SGLANG_HARDEN_HOME/venvs/<version>``), an
unpacked wheel cached under ``$SGLANG_HARDEN_HOME/wheel-src/<version>``, or ``pip download --no-deps
sglang==<version>`` (the package index pip is configured for), of which only ``sglang/**/*.py`` is unpacked.
The pip is the running Python's, else its base interpreter's, else ``python3``'s on ``PATH``: a venv built by uv
(every testbed pin venv) has no pip of its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

from sglang_harden.compat.pins import RELEASE_RE, release_key
from sglang_harden.testbed.envs import harden_home, venv_dir


class ReleaseUnavailable(RuntimeError):
    """No tree for a release here, and the download failed (offline, no such release)."""


def pip_command() -> list[str]:
    """``[python, "-m", "pip"]`` for the first interpreter here that has pip (see the module docstring)."""
    candidates = [sys.executable, getattr(sys, "_base_executable", ""), shutil.which("python3") or "",
                  "/usr/bin/python3"]
    for python in dict.fromkeys(c for c in candidates if c):
        try:
            probe = subprocess.run([python, "-c", "import pip"], capture_output=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return [python, "-m", "pip"]
    raise ReleaseUnavailable(f"no pip here: neither {sys.executable}, its base interpreter nor python3 on PATH has one "
                             "(install pip for python3)")


def index_releases(timeout_s: float = 120.0) -> list[str]:
    """Final releases of ``sglang`` on the package index, oldest first (``pip index versions``)."""
    cmd = [*pip_command(), "index", "versions", "sglang"]
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
    with _exclusive(unpacked.with_name(f"{version}.lock")):  # other processes (test workers) may want it too
        if (unpacked / "sglang" / "srt").is_dir():
            return unpacked
        return _unpack(_download(version), unpacked)


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _download(version: str) -> Path:
    cache = harden_home() / "wheel-cache"
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob(f"sglang-{version}-*.whl"))
    if wheels:
        return wheels[-1]
    cmd = [*pip_command(), "download", "--no-deps", "--only-binary", ":all:", "-q",
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
