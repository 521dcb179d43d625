"""Build and cache the small C libraries next to this package (the native digest, the native ledger).

A library is compiled with the system C compiler into ``$SGLANG_HARDEN_HOME/kernels`` (default
``~/.cache/sglang-harden/kernels``), keyed by its source and the flags (which name the CPU features and, for an
extension module, the Python headers), and loaded with ctypes. It is built by ``sglang-harden build-kernels`` (an
image's build step) or else on first use; a library already in the folder is loaded without a compiler. Each
library has an environment switch (``0`` disables it); callers keep a pure-Python/numpy/torch path for when a
library is disabled or cannot be built.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

BASE_FLAGS = ("-O3", "-shared", "-fPIC", "-fno-strict-aliasing")
BUILD_TIMEOUT_S = 120


def cache_dir() -> Path:
    home = os.environ.get("SGLANG_HARDEN_HOME") or str(Path.home() / ".cache" / "sglang-harden")
    return Path(home) / "kernels"


def find_compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cpu_flags() -> tuple[str, ...]:
    """``-mavx2`` where this CPU has AVX2 (the build is cached per flag set, so mixed fleets stay safe)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ()
    return ("-mavx2",) if " avx2" in info else ()


def disabled(env: str) -> bool:
    """The switch ``env`` is set to 0/false/no/off."""
    return os.environ.get(env, "1").strip().lower() in ("0", "false", "no", "off")


def library_path(source: Path, prefix: str, flags: Sequence[str]) -> Path:
    key = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    return cache_dir() / f"{prefix}-{key}.so"


def build(source: Path, compiler: str, flags: Sequence[str], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run(
            [compiler, *flags, "-o", tmp, str(source)],
            check=True,
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
        )
        os.replace(tmp, target)  # atomic: ranks building at once each install a whole library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_library(
    source: Path, prefix: str, env: str, flags: Sequence[str], loader: Callable[[str], Any] = ctypes.CDLL
) -> tuple[Any, str]:
    """``(library, how it was built)`` or ``(None, why not)``: builds ``source`` on first use, then loads it with
    ``loader`` (a ctypes library by default; :func:`import_extension` for a CPython extension module)."""
    if disabled(env):
        return None, f"disabled by {env}"
    target = library_path(source, prefix, flags)
    how = f"loaded the library built before at {target}"
    try:
        if not target.exists():
            compiler = find_compiler()
            if compiler is None:
                return None, f"no C compiler (cc, gcc, clang or $CC) on PATH and no library at {target}"
            build(source, compiler, flags, target)
            how = f"built with {compiler} {' '.join(flags)} at {target}"
        lib = loader(str(target))
    except subprocess.CalledProcessError as exc:
        return None, f"build failed: {exc.stderr.strip()[-300:]}"
    except (OSError, ImportError, subprocess.TimeoutExpired) as exc:
        return None, f"build or load failed: {exc}"
    return lib, how


def import_extension(module_name: str, path: str) -> Any:
    """Import the CPython extension module ``module_name`` (its ``PyInit_<module_name>``) from the file ``path``."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
