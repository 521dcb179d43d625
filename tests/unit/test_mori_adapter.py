"""MORI: covered by reading its code, because it cannot run here.

MORI (SGLang's ROCm/RDMA transfer backend, 0.5.9+) hard-codes the RDMA backend and GPU memory, and its only
wheel is cp310 + ROCm 7; nothing of it can execute on this CPU machine. The guards reach it only through the
backend-independent layer: ``CommonKVReceiver.__init__`` (decode watches rooms), ``CommonKVBootstrapServer.
_setup_routes`` (the abort routes), ``CommonKVSender.abort`` (retire), and ``MetadataBuffers`` (coverage).
This test parses each pin's ``mori/conn.py`` (no import) and asserts MORI's classes derive from exactly those
bases and do not override the hooked methods without calling through — so the hooks cover MORI too. It fails
if a pin changes MORI's class layout, which is when the adapter would need a MORI-specific hook.
"""

from __future__ import annotations

import ast
import io
import zipfile
from pathlib import Path

import pytest

from sglang_harden.compat import SUPPORTED_PINS

SRC_CACHE = Path.home() / ".cache" / "sglang-harden" / "src"
EXPECTED_BASES = {
    "MoriKVManager": "CommonKVManager",
    "MoriKVSender": "CommonKVSender",
    "MoriKVReceiver": "CommonKVReceiver",
    "MoriKVBootstrapServer": "CommonKVBootstrapServer",
}
HOOKED = {"MoriKVReceiver": ("__init__",), "MoriKVBootstrapServer": ("_setup_routes",), "MoriKVSender": ("abort",)}
MORI_PINS = [p for p in SUPPORTED_PINS if p.startswith("0.5.")]


def _mori_source(pin: str) -> str:
    """``sglang/srt/disaggregation/mori/conn.py`` of ``pin``: from its venv, a cached wheel, or PyPI."""
    venv_file = (Path.home() / ".cache" / "sglang-harden" / "venvs" / pin / "lib" / "python3.11" / "site-packages"
                 / "sglang" / "srt" / "disaggregation" / "mori" / "conn.py")
    if venv_file.exists():
        return venv_file.read_text()
    for wheel in sorted(SRC_CACHE.glob(f"**/sglang-{pin}-*.whl")):
        with zipfile.ZipFile(wheel) as archive:
            return archive.read("sglang/srt/disaggregation/mori/conn.py").decode()
    return _download(pin)


def _download(pin: str) -> str:
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp,
                               f"sglang=={pin}"], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            pytest.fail(f"cannot read SGLang {pin}'s MORI adapter: no venv, no cached wheel, pip: {done.stderr[-300:]}")
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(io.BytesIO(wheel.read_bytes())) as archive:
            return archive.read("sglang/srt/disaggregation/mori/conn.py").decode()


def _classes(source: str) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)}


def _calls_super(method: ast.FunctionDef) -> bool:
    for node in ast.walk(method):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            inner = node.func.value
            if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name) and inner.func.id == "super":
                return node.func.attr == method.name
    return False


@pytest.mark.parametrize("pin", MORI_PINS)
def test_mori_classes_inherit_the_hooked_common_layer(pin: str) -> None:
    classes = _classes(_mori_source(pin))
    for name, base in EXPECTED_BASES.items():
        assert name in classes, f"{pin}: MORI has no {name}"
        bases = [b.id for b in classes[name].bases if isinstance(b, ast.Name)]
        assert base in bases, f"{pin}: {name} bases {bases}, expected {base}"


@pytest.mark.parametrize("pin", MORI_PINS)
def test_mori_does_not_bypass_hooked_methods(pin: str) -> None:
    classes = _classes(_mori_source(pin))
    for name, methods in HOOKED.items():
        for item in classes[name].body:
            if isinstance(item, ast.FunctionDef) and item.name in methods:
                assert _calls_super(item), f"{pin}: {name}.{item.name} overrides the hooked method without super()"
