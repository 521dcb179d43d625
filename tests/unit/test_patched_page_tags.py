"""The page-tag patch's module (``sglang/srt/mem_cache/pd_page_tags.py`` of a patched tree), imported from the file
the series writes, on stand-ins for SGLang's allocator, receiver, request and page table (numpy arrays where SGLang
passes tensors; it imports nothing of SGLang). The real patched servers are ``tests/e2e/test_patched_incident.py``.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import numpy as np
import pytest
from test_patch import load_series_module, make_tree, patched_trees

from sglang_harden.tools import patch as P

MODULE = "sglang/srt/mem_cache/pd_page_tags.py"
PINS = [pin for pin in P.available_pins(P.default_patches_dir()) if pin.startswith("0.5.")]


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return patched_trees(tmp_path_factory, ("0.5.19", "0.5.23"))


def load(tree: Path, monkeypatch: pytest.MonkeyPatch, mode: str | None = None) -> ModuleType:
    return load_series_module(tree / MODULE, "SGLANG_HARDEN_PAGE_TAGS", mode, monkeypatch)


def receiver(room: int) -> Any:
    return SimpleNamespace(bootstrap_room=room, bootstrap_infos=[{"rank": 0}])


def make_req(room: int, prompt_len: int, pool_idx: int, prefix: list[int] | None = None) -> Any:
    return SimpleNamespace(rid=f"r{room}", bootstrap_room=room, origin_input_ids=[1] * prompt_len,
                           kv=SimpleNamespace(req_pool_idx=pool_idx), prefix_indices=prefix or [])


@pytest.fixture(params=["0.5.19", "0.5.23"])
def tags(request: pytest.FixtureRequest, trees: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load(trees[request.param], monkeypatch)


def test_every_05_series_carries_the_module() -> None:
    assert PINS
    for pin in PINS:
        assert any(MODULE in p.targets for p in P.load_series(pin, P.default_patches_dir())), pin


def test_own_written_pages_pass_and_free_pages_are_forgotten(tags: ModuleType) -> None:
    allocator = SimpleNamespace(size=64, page_size=1)
    table = np.zeros((4, 16), dtype=np.int32)
    table[0, :4] = [5, 6, 7, 8]
    tags.note_published(allocator, receiver(7), np.array([5, 6, 7, 8], dtype=np.int32))
    assert tags.refusal_at_commit(make_req(7, 4, 0), table) is None
    tags.note_freed(allocator, np.array([5, 6, 7, 8]))
    assert all(tags.NODE.ledger.state(p) == tags.PageState.FREE for p in (5, 6, 7, 8))
    # the pages are someone else's now: a new reservation of them is accepted
    tags.note_published(allocator, receiver(9), np.array([5, 6], dtype=np.int32))
    table[1, :2] = [5, 6]
    assert tags.refusal_at_commit(make_req(9, 2, 1), table) is None


def test_a_free_page_in_the_table_is_refused(tags: ModuleType) -> None:
    """The kvfault ``table`` case: the table points one prompt row at a page in the free list."""
    allocator = SimpleNamespace(size=64, page_size=1)
    table = np.zeros((4, 16), dtype=np.int32)
    tags.note_published(allocator, receiver(7), np.array([5, 6, 7, 8]))
    table[0, :4] = [5, 6, 40, 8]
    reason = tags.refusal_at_commit(make_req(7, 4, 0), table)
    assert reason is not None and "KV page 40" in reason and "FREE" in reason


def test_another_requests_page_is_refused_and_named(tags: ModuleType) -> None:
    allocator = SimpleNamespace(size=64, page_size=1)
    table = np.zeros((4, 16), dtype=np.int32)
    tags.note_published(allocator, receiver(8), np.array([20, 21]))
    tags.note_published(allocator, receiver(7), np.array([5, 6]))
    table[0, :2] = [5, 21]
    reason = tags.refusal_at_commit(make_req(7, 2, 0), table)
    assert reason is not None and "KV page 21" in reason and "'room:8'" in reason


def test_paged_pool_checks_pages_and_keeps_the_cached_prefix(tags: ModuleType) -> None:
    """Page size 4: the table holds token slots; a cached-prefix page (written by an earlier transfer, still held by
    the prefix cache) is allowed, an unwritten one is not."""
    allocator = SimpleNamespace(size=64, page_size=4)
    table = np.zeros((4, 32), dtype=np.int64)
    tags.note_published(allocator, receiver(1), np.array([2]))
    table[0, :4] = np.arange(8, 12)
    assert tags.refusal_at_commit(make_req(1, 4, 0), table) is None  # page 2, written, stays cached
    tags.note_published(allocator, receiver(2), np.array([3, 4]))
    table[1, :12] = np.concatenate([np.arange(8, 12), np.arange(12, 20)])
    assert tags.refusal_at_commit(make_req(2, 12, 1, prefix=list(range(8, 12))), table) is None
    tags.note_published(allocator, receiver(3), np.array([5]))
    table[2, :8] = np.concatenate([np.arange(36, 40), np.arange(20, 24)])  # prefix page 9 was never written
    reason = tags.refusal_at_commit(make_req(3, 8, 2, prefix=list(range(36, 40))), table)
    assert reason is not None and "cached-prefix page is FREE" in reason


def test_pages_not_free_at_publish_and_unknown_rooms_fail_closed(tags: ModuleType) -> None:
    allocator = SimpleNamespace(size=64, page_size=1)
    table = np.zeros((4, 16), dtype=np.int32)
    assert "no page ledger" in tags.refusal_at_commit(make_req(3, 2, 0), table)
    tags.note_published(allocator, receiver(7), np.array([5, 6]))
    tags.note_published(allocator, receiver(8), np.array([6, 9]))  # page 6 was never freed by the allocator
    table[1, :2] = [6, 9]
    assert "not free in the page ledger" in tags.refusal_at_commit(make_req(8, 2, 1), table)
    assert "no record" in tags.refusal_at_commit(make_req(99, 2, 2), table)


def test_another_allocator_and_unpublished_receivers_are_ignored(tags: ModuleType) -> None:
    allocator, other = SimpleNamespace(size=64, page_size=1), SimpleNamespace(size=64, page_size=1)
    tags.note_published(allocator, SimpleNamespace(bootstrap_room=7, bootstrap_infos=None), np.array([5]))
    assert tags.NODE is None  # nothing was published (SGLang failed the room): no writer
    tags.note_published(allocator, receiver(7), np.array([5]))
    tags.note_freed(other, np.array([5]))  # prefill's allocator, or a draft model's
    assert tags.NODE.ledger.state(5) == tags.PageState.WRITING


def test_modes(trees: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
               caplog: pytest.LogCaptureFixture) -> None:
    tree = trees["0.5.23"]
    allocator = SimpleNamespace(size=64, page_size=1)
    table = np.zeros((2, 8), dtype=np.int32)
    table[0, :2] = [5, 40]
    log = load(tree, monkeypatch, "log")
    log.note_published(allocator, receiver(7), np.array([5, 6]))
    assert log.refusal_at_commit(make_req(7, 2, 0), table) is None
    assert "abort_logged" in caplog.text and "KV page 40" in caplog.text
    off = load(tree, monkeypatch, "off")
    off.note_published(allocator, receiver(7), np.array([5, 6]))
    assert off.NODE is None and off.refusal_at_commit(make_req(7, 2, 0), table) is None
    with pytest.raises(ValueError, match="SGLANG_HARDEN_PAGE_TAGS='clamp'"):
        load(tree, monkeypatch, "clamp")


@pytest.mark.parametrize("pin", ["0.5.19", "0.5.23"])
def test_doctor_recognises_the_patched_page_tags(pin: str, trees: dict[str, Path], tmp_path: Path) -> None:
    """doctor judges the patched tree by its code: the ownership check before the commit and both allocators'
    free paths feeding its ledger; a pristine tree has neither, and a tree whose allocators were left unpatched is
    only partly protected."""
    from sglang_harden.tools import _protections as protections
    from sglang_harden.tools._source import SourceTree

    assert protections.detect_page_ownership(SourceTree(trees[pin])).status == protections.YES
    assert protections.detect_page_ownership(SourceTree(make_tree(pin, tmp_path / "pristine"))).status == \
        protections.NO
    partial = make_tree(pin, tmp_path / "partial")
    P.apply_series(partial, pin)
    paged = partial / "sglang/srt/mem_cache/allocator/paged.py"
    paged.write_text(paged.read_text().replace("        pd_page_tags.note_freed(self, *page_ids)", "        pass"))
    found = protections.detect_page_ownership(SourceTree(partial))
    assert found.status == protections.PARTIAL and "not told of freed pages" in found.detail, found
