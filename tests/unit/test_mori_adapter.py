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

import pytest

from sglang_harden.compat import SUPPORTED_PINS
from sglang_harden.tools._wheels import ReleaseUnavailable, release_tree

EXPECTED_BASES = {
    "MoriKVManager": "CommonKVManager",
    "MoriKVSender": "CommonKVSender",
    "MoriKVReceiver": "CommonKVReceiver",
    "MoriKVBootstrapServer": "CommonKVBootstrapServer",
}
HOOKED = {"MoriKVReceiver": ("__init__",), "MoriKVBootstrapServer": ("_setup_routes",), "MoriKVSender": ("abort",)}
MORI_PINS = [p for p, family in SUPPORTED_PINS.items() if family == "sglang_v05"]  # 0.4.9 adapter: no MORI


def _mori_source(pin: str) -> str:
    """``sglang/srt/disaggregation/mori/conn.py`` of ``pin``: from its venv, an unpacked wheel, or PyPI."""
    try:
        tree = release_tree(pin)
    except ReleaseUnavailable as exc:
        pytest.fail(f"cannot read SGLang {pin}'s MORI adapter: {exc}")
    return (tree / "sglang" / "srt" / "disaggregation" / "mori" / "conn.py").read_text()


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
