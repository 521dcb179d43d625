"""Reserved-page canary: the commit decision (pure) and fixed-slot stamps (torch; skipped without it)."""

from __future__ import annotations

import importlib.util

import pytest

from sglang_harden.compat.kv_canary import check_stamps, stamp, still_stamped
from sglang_harden.guards.base import Verdict
from sglang_harden.guards.canary import decide_commit, new_marker, stamp_slots

needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="torch not installed: run with a pin venv's python"
)


def test_unwritten_reserved_page_aborts_naming_it() -> None:
    decision = decide_commit("r", (4, 9, 2), [9])
    assert decision.verdict is Verdict.ABORT and decision.status_code == 500
    assert decision.fields["unwritten_pages"] == [9] and decision.fields["unwritten_count"] == 1
    assert "1 of 3 reserved KV pages" in decision.reason
    assert decide_commit("r", (4, 9, 2), []).verdict is Verdict.ALLOW


def test_large_reservation_reports_a_bounded_list() -> None:
    decision = decide_commit("r", list(range(10_000)), range(0, 10_000, 2))
    assert decision.fields["unwritten_count"] == 5000 and len(decision.fields["unwritten_pages"]) == 8


def test_markers_are_fresh_and_nonzero() -> None:
    markers = {new_marker("r") for _ in range(100)}
    assert len(markers) == 100 and 0 not in markers and all(m < 1 << 64 for m in markers)


def test_stamp_slots_use_the_first_sent_token_of_each_page() -> None:
    assert stamp_slots([3, 7, 1], 16) == [48, 112, 16]
    assert stamp_slots([3, 7], 16, first_offset=5) == [53, 112]


@needs_torch
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16", "uint8"])
def test_stamps_catch_a_page_the_transfer_skipped(dtype_name: str) -> None:
    import torch

    dtype = getattr(torch, dtype_name)
    page, heads, dim = 4, 2, 64
    k0 = torch.zeros(64, heads, dim, dtype=dtype)
    v_last = torch.zeros(64, heads, dim, dtype=dtype)
    pages = [3, 9, 5]
    marker = new_marker("r")
    stamp([k0, v_last], stamp_slots(pages, page), marker)
    assert still_stamped([k0, v_last], stamp_slots(pages, page), marker) == [0, 1, 2]

    # the transfer writes pages 3 and 5 completely, page 9 only in the first layer (cut short)
    for p in (3, 5):
        k0[p * page : (p + 1) * page] = torch.ones(page, heads, dim, dtype=dtype)
        v_last[p * page : (p + 1) * page] = torch.ones(page, heads, dim, dtype=dtype)
    k0[9 * page : 10 * page] = torch.ones(page, heads, dim, dtype=dtype)
    decision = check_stamps("r", [k0, v_last], pages, page, marker)
    assert decision.verdict is Verdict.ABORT and decision.fields["unwritten_pages"] == [9]

    v_last[9 * page : 10 * page] = torch.ones(page, heads, dim, dtype=dtype)
    assert check_stamps("r", [k0, v_last], pages, page, marker).verdict is Verdict.ALLOW


@needs_torch
def test_stamp_touches_only_the_fixed_slot_of_reserved_pages() -> None:
    import torch

    buf = torch.randn(32, 2, 16, dtype=torch.bfloat16)
    before = buf.clone()
    stamp([buf], stamp_slots([2, 6], 4), new_marker())
    changed = (buf != before).reshape(32, -1).any(dim=1).nonzero().flatten().tolist()
    assert changed == [8, 24]
    assert torch.equal(buf[8, 0, 4:], before[8, 0, 4:]) and torch.equal(buf[8, 1], before[8, 1])
    # an old marker never reads as "still stamped" after a new reservation
    assert still_stamped([buf], [8, 24], new_marker()) == []
