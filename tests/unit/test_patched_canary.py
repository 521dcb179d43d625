"""The canary patch's module (``sglang/srt/disaggregation/common/pd_canary.py`` of a patched tree), imported from the
file the series writes, on real torch KV buffers (a stand-in pool object holding them; it imports nothing of SGLang).
Needs torch: ``scripts/run_tests.sh`` runs it with a CI pin's venv python. The real patched servers are
``tests/e2e/test_patched_incident.py``.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from test_patch import load_series_module, make_tree, patched_trees  # noqa: E402

from sglang_harden.tools import patch as P  # noqa: E402

MODULE = "sglang/srt/disaggregation/common/pd_canary.py"
PAGE = 4


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return patched_trees(tmp_path_factory, ("0.5.19", "0.5.23"))


def load(tree: Path, monkeypatch: pytest.MonkeyPatch, mode: str | None = None) -> ModuleType:
    return load_series_module(tree / MODULE, "SGLANG_HARDEN_CANARY", mode, monkeypatch)


@pytest.fixture(params=["0.5.19", "0.5.23"])
def canary(request: pytest.FixtureRequest, trees: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> Any:
    return load(trees[request.param], monkeypatch)


def pool(layers: int = 3) -> Any:
    """A KV pool's shape: per layer K and V ``[slots, heads, dim]`` (bf16), 16 pages of ``PAGE`` slots."""
    def buffers() -> list[Any]:
        return [torch.zeros(16 * PAGE, 2, 8, dtype=torch.bfloat16) for _ in range(layers)]

    return SimpleNamespace(k_buffer=buffers(), v_buffer=buffers(), page_size=PAGE)


def receiver(room: int) -> Any:
    return SimpleNamespace(bootstrap_room=room)


def req(room: int) -> Any:
    return SimpleNamespace(rid=f"r{room}", bootstrap_room=room)


def write(kv: Any, pages: list[int], layers: str = "kv") -> None:
    """What a transfer does: whole pages, every layer (``layers``: which of K and V it got to)."""
    for page in pages:
        rows = slice(page * PAGE, (page + 1) * PAGE)
        for buffer in (kv.k_buffer if "k" in layers else []) + (kv.v_buffer if "v" in layers else []):
            buffer[rows] = torch.randn(PAGE, 2, 8).to(torch.bfloat16)


def test_every_series_carries_the_module() -> None:
    pins = P.available_pins(P.default_patches_dir())
    assert {"0.4.9.post6", "0.4.10.post2", "0.5.23"} <= set(pins)
    for pin in pins:
        assert any(MODULE in p.targets for p in P.load_series(pin, P.default_patches_dir())), pin


def test_written_pages_pass(canary: ModuleType) -> None:
    kv = pool()
    canary.stamp_before_send(kv, receiver(7), [2, 3, 5])
    assert bool(kv.k_buffer[0][2 * PAGE].view(torch.uint8).any())  # the stamp: the first row of each page, as bits
    write(kv, [2, 3, 5])
    assert canary.refusal_at_commit(req(7), None) is None


def test_an_unwritten_page_is_refused_and_named(canary: ModuleType) -> None:
    kv = pool()
    canary.stamp_before_send(kv, receiver(8), [4, 6])
    write(kv, [4])
    reason = canary.refusal_at_commit(req(8), None)
    assert reason is not None and "1 of 2 reserved KV pages were never written" in reason and "[6]" in reason


def test_a_transfer_cut_short_before_the_last_layer_is_refused(canary: ModuleType) -> None:
    kv = pool()
    canary.stamp_before_send(kv, receiver(9), [1])
    write(kv, [1], layers="k")  # every K layer written, the V layers never reached
    assert "never written" in (canary.refusal_at_commit(req(9), None) or "")


def test_no_stamp_fails_closed_and_rooms_are_stamped_once(canary: ModuleType) -> None:
    kv = pool()
    assert "no canary stamp recorded" in (canary.refusal_at_commit(req(3), None) or "")
    canary.stamp_before_send(kv, receiver(4), [2])
    write(kv, [2])
    canary.stamp_before_send(kv, receiver(4), [2])  # a second publish of the room stamps nothing (a write may fly)
    assert canary.refusal_at_commit(req(4), None) is None
    assert "no canary stamp recorded" in (canary.refusal_at_commit(req(4), None) or "")  # a stamp is used once


def test_modes(trees: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
               caplog: pytest.LogCaptureFixture) -> None:
    tree = trees["0.5.23"]
    log = load(tree, monkeypatch, "log")
    kv = pool()
    log.stamp_before_send(kv, receiver(7), [2])
    assert log.refusal_at_commit(req(7), None) is None
    assert "abort_logged" in caplog.text and "never written" in caplog.text
    off = load(tree, monkeypatch, "off")
    kv = pool()
    off.stamp_before_send(kv, receiver(7), [2])
    assert not any(bool(buffer.view(torch.uint8).any()) for buffer in kv.k_buffer + kv.v_buffer)  # nothing stamped
    assert off.refusal_at_commit(req(7), None) is None
    with pytest.raises(ValueError, match="SGLANG_HARDEN_CANARY='strict'"):
        load(tree, monkeypatch, "strict")


def test_doctor_recognises_the_patched_canary(trees: dict[str, Path], tmp_path: Path) -> None:
    from sglang_harden.tools import _protections as protections
    from sglang_harden.tools._source import SourceTree

    found = protections.detect_kv_canary(SourceTree(trees["0.5.19"]))
    assert found.status == protections.YES and "backport" in found.detail, found
    assert protections.detect_kv_canary(SourceTree(make_tree("0.5.19", tmp_path / "pristine"))).status == \
        protections.NO
