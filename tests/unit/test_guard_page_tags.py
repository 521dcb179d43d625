from sglang_harden.guards.base import Verdict
from sglang_harden.guards.lifecycle import PageLedger
from sglang_harden.guards.page_tags import check_page_table


def written(ledger, owner, pages):
    gen = ledger.reserve(owner, pages)
    ledger.begin_write(owner, pages)
    ledger.finish_write(owner, pages)
    return gen


def test_own_written_pages_pass():
    ledger = PageLedger(4)
    gen = written(ledger, "b", [1, 2])
    assert check_page_table(ledger, "b", gen, [1, 2]).verdict is Verdict.ALLOW


def test_foreign_page_names_page_and_owner():
    ledger = PageLedger(4)
    written(ledger, "a", [0])
    gen = written(ledger, "b", [1])
    d = check_page_table(ledger, "b", gen, [1, 0])
    assert d.verdict is Verdict.ABORT and "page 0" in d.reason and "'a'" in d.reason
    assert d.fields["actual_owner"] == "a"


def test_reserved_but_unwritten_page_fails():
    ledger = PageLedger(2)
    gen = ledger.reserve("b", [0, 1])
    ledger.begin_write("b", [0, 1])
    ledger.finish_write("b", [0])
    d = check_page_table(ledger, "b", gen, [0, 1])
    assert d.verdict is Verdict.ABORT and "page 1" in d.reason and "WRITING" in d.reason


def test_stale_generation_fails():
    ledger = PageLedger(1)
    old = written(ledger, "b", [0])
    ledger.release("b", [0], True)
    written(ledger, "b", [0])
    d = check_page_table(ledger, "b", old, [0])
    assert d.verdict is Verdict.ABORT and "generation" in d.reason


def test_free_page_fails():
    ledger = PageLedger(2)
    gen = written(ledger, "b", [0])
    assert check_page_table(ledger, "b", gen, [0, 1]).verdict is Verdict.ABORT


def test_own_cached_prefix_is_accepted():
    ledger = PageLedger(3)
    written(ledger, "cache", [0])
    gen = written(ledger, "b", [1])
    assert check_page_table(ledger, "b", gen, [0, 1], own_prefix_pages=[0]).verdict is Verdict.ALLOW
    assert check_page_table(ledger, "b", gen, [2, 1], own_prefix_pages=[2]).verdict is Verdict.ABORT
