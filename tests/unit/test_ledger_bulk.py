"""The ledger's bulk (numpy) operations follow exactly the rules of the per-page ones."""

from __future__ import annotations

import random

import pytest

from sglang_harden.guards.lifecycle import LedgerError, PageLedger, PageState

np = pytest.importorskip("numpy")


def _drive(bulk: bool, seed: int) -> tuple[object, list[object]]:
    rng = random.Random(seed)
    ledger = PageLedger(64)
    log: list[object] = []
    held: dict[str, list[int]] = {}
    free = list(range(64))
    for step in range(200):
        op = rng.choice(("reserve", "write", "finish", "release", "confirm"))
        if op == "reserve" and free:
            pages = sorted(rng.sample(free, min(len(free), rng.randint(1, 6))))
            owner = f"o{step}"
            gen = ledger.reserve_bulk(owner, np.array(pages)) if bulk else ledger.reserve(owner, pages)
            held[owner] = pages
            free = [p for p in free if p not in pages]
            log.append(("reserve", gen))
        elif op in ("write", "finish") and held:
            owner = rng.choice(sorted(held))
            target = PageState.WRITING if op == "write" else PageState.WRITTEN
            if bulk:
                refused = ledger.move_bulk(owner, np.array(held[owner]), target).tolist()
            else:
                move = ledger.begin_write if op == "write" else ledger.finish_write
                refused = move(owner, held[owner])
            log.append((op, refused))
        elif op == "release" and held:
            owner = rng.choice(sorted(held))
            drained = rng.random() < 0.5
            pages = held.pop(owner)
            out = (ledger.release_bulk(owner, np.array(pages), drained) if bulk
                   else ledger.release(owner, pages, drained))
            freed, quarantined, ignored = ([int(p) for p in part] for part in (out.to_free, out.to_quarantine,
                                                                                out.ignored))
            free += freed
            log.append(("release", sorted(freed), sorted(quarantined), sorted(ignored)))
        elif op == "confirm":
            for owner in ledger.quarantined_owners():
                free += ledger.confirm_drained(owner)
            log.append(("confirm", ledger.quarantined_count()))
    return ledger.snapshot(), log


@pytest.mark.parametrize("seed", range(20))
def test_bulk_matches_per_page(seed: int) -> None:
    assert _drive(True, seed) == _drive(False, seed)


def test_bulk_reserve_refuses_a_page_in_use() -> None:
    ledger = PageLedger(8)
    ledger.reserve_bulk("a", np.array([1, 2]))
    with pytest.raises(LedgerError):
        ledger.reserve_bulk("b", np.array([2, 3]))


def test_all_owned_written_fast_path() -> None:
    ledger = PageLedger(8)
    gen = ledger.reserve_bulk("a", np.array([1, 2, 3]))
    pages = np.array([1, 2, 3])
    ledger.move_bulk("a", pages, PageState.WRITING)
    assert not ledger.all_owned_written("a", gen, pages)
    ledger.move_bulk("a", pages, PageState.WRITTEN)
    assert ledger.all_owned_written("a", gen, pages)
    assert not ledger.all_owned_written("a", gen + 1, pages)
    assert not ledger.all_owned_written("b", gen, pages)


def test_duplicate_pages_are_harmless() -> None:
    """A page listed twice (several tokens of one page) is reserved, written and released once."""
    ledger = PageLedger(8)
    pages = np.array([3, 3, 4, 4, 4])
    gen = ledger.reserve_bulk("a", pages, PageState.WRITING)
    assert ledger.move_bulk("a", pages, PageState.WRITTEN).size == 0
    assert ledger.all_owned_written("a", gen, pages)
    out = ledger.release_bulk("a", np.array([3, 3]), writer_drained=True)
    assert sorted(set(out.to_free.tolist())) == [3]
    assert ledger.holds_pages("a"), "page 4 is still a's"
    ledger.release_bulk("a", np.array([4, 4, 4]), writer_drained=True)
    assert not ledger.holds_pages("a")
    assert not np.count_nonzero(ledger.state_array()), "every page FREE again"


def test_quarantine_counts_a_duplicated_page_once() -> None:
    ledger = PageLedger(8)
    ledger.reserve_bulk("a", np.array([1, 2]), PageState.WRITING)
    out = ledger.release_bulk("a", np.array([1, 1, 2]), writer_drained=False)
    assert out.to_quarantine.tolist() == [1, 2] and ledger.quarantined_count() == 2
    assert sorted(ledger.confirm_drained("a")) == [1, 2]
    assert not ledger.holds_pages("a")


def test_page_at_a_foreign_generation_fails_the_fast_path() -> None:
    ledger = PageLedger(8)
    gen = ledger.reserve_bulk("a", np.array([1, 2]), PageState.WRITING)
    ledger.move_bulk("a", np.array([1, 2]), PageState.WRITTEN)
    ledger.release_bulk("a", np.array([2]), writer_drained=True)
    ledger.reserve_bulk("b", np.array([2]), PageState.WRITING)
    ledger.move_bulk("b", np.array([2]), PageState.WRITTEN)
    assert not ledger.all_owned_written("a", gen, np.array([1, 2]))
    assert not ledger.all_owned_written("a", gen, np.array([2, 1]))
