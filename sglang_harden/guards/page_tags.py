"""Page ownership tags: a request's first decode step reads only pages it owns and its own transfer wrote.

Invariant: before the first decode step after a transfer commit, every page in the request's page table
is, in the node's :class:`~sglang_harden.guards.lifecycle.PageLedger`, owned by that request at the
generation of its reservation and WRITTEN (its own transfer completed into it), or is one of the request's
own cached-prefix pages (WRITTEN, any owner: the cache holds those). Otherwise the request is aborted and
never generated.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from sglang_harden.guards.base import Decision, Verdict, allow
from sglang_harden.guards.lifecycle import PageLedger, PageState

GUARD = "page_tags"


def _page_problem(ledger: PageLedger, owner: str, generation: int, page: int, prefix: bool) -> str | None:
    state = ledger.state(page)
    if prefix:
        return None if state == PageState.WRITTEN else f"cached-prefix page is {state.name}"
    actual_owner, actual_generation = ledger.owner(page), ledger.generation(page)
    if actual_owner != owner:
        return f"owned by {actual_owner!r} (state {state.name}, generation {actual_generation})"
    if actual_generation != generation:
        return f"from generation {actual_generation}, not {generation}"
    if state != PageState.WRITTEN:
        return f"is {state.name}, not WRITTEN by this request's transfer"
    return None


def check_page_table(
    ledger: PageLedger,
    owner: str,
    generation: int,
    pages: Sequence[int],
    own_prefix_pages: Collection[int] = (),
) -> Decision:
    """ALLOW decoding over ``pages``, or ABORT naming the first page that fails and who actually holds it."""
    prefix = set(own_prefix_pages)
    for page in pages:
        problem = _page_problem(ledger, owner, generation, page, page in prefix)
        if problem is not None:
            reason = f"request {owner}: KV page {page} {problem}; refusing to decode"
            fields = {
                "rid": owner,
                "page": page,
                "actual_owner": ledger.owner(page),
                "generation": generation,
            }
            return Decision(GUARD, Verdict.ABORT, reason, 500, fields)
    return allow(GUARD, rid=owner, pages=len(pages))
