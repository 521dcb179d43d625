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
            free += out.to_free
            log.append(("release", sorted(out.to_free), sorted(out.to_quarantine), sorted(out.ignored)))
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
