"""The soak's KV tracer sees what it claims (issue 40): owners of every request that held a slot, not only of those
that finished, and rows another request's transfer overwrote only in part.

The tracer shim runs here on a stand-in scheduler with SGLang's buffer layout (per layer K and V ``[slots, heads,
dim]`` tensors, ``req_to_token``, an allocator with ``free``): SGLang's scheduler cannot run in this process. Each
case also runs the tracer's earlier rules (owners only at a finished release, whole rows only) on the same rows,
and shows they saw nothing there.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from sglang_harden.testbed.procenv import SHIMS_DIR

torch = pytest.importorskip("torch")

LAYERS, HEADS, DIM, SLOTS = 2, 1, 4, 32


class Allocator:
    def __init__(self, pool: Any) -> None:
        self.pool, self.freed = pool, []

    def get_kvcache(self) -> Any:
        return self.pool

    def free(self, index: Any) -> None:
        self.freed.append(index.tolist())


def _scheduler() -> Any:
    pool = SimpleNamespace(k_buffer=[torch.zeros(SLOTS, HEADS, DIM) for _ in range(LAYERS)],
                           v_buffer=[torch.zeros(SLOTS, HEADS, DIM) for _ in range(LAYERS)])
    return SimpleNamespace(token_to_kv_pool_allocator=Allocator(pool), page_size=1,
                           req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(4, SLOTS, dtype=torch.long)))


def _req(rid: str, idx: int, tokens: list[int], slots: list[int], sched: Any) -> Any:
    sched.req_to_token_pool.req_to_token[idx, : len(slots)] = torch.tensor(slots)
    return SimpleNamespace(rid=rid, req_pool_idx=idx, origin_input_ids=tokens, output_ids=[])


def _write(sched: Any, slots: list[int], value: float, layers: range = range(LAYERS)) -> None:
    pool = sched.token_to_kv_pool_allocator.pool
    for layer in layers:
        for buf in (pool.k_buffer[layer], pool.v_buffer[layer]):
            buf[slots] = value + layer + torch.arange(len(slots), dtype=torch.float32).reshape(-1, 1, 1)


@pytest.fixture
def tracer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(SHIMS_DIR))
    monkeypatch.setenv("SGLANG_HARDEN_TESTBED_KVTRACE_DIR", str(tmp_path))
    import sglang_harden_kvtrace

    shim = importlib.reload(sglang_harden_kvtrace)
    queue_cls = type("Queue", (), {"_pre_alloc": lambda self, req: None})
    pre_alloc = shim._wrap_pre_alloc(queue_cls._pre_alloc)
    shim.test_pre_alloc = lambda sched, req: pre_alloc(SimpleNamespace(scheduler=sched), req)
    shim.test_events = lambda: [json.loads(line) for p in tmp_path.glob("kvtrace-*.jsonl")
                                for line in p.read_text().splitlines()]
    return shim


def _earlier_rules_foreign(owner_hashes: list[Any], now: list[Any], finished: bool) -> int:
    """The tracer before issue 40: an owner only at a finished release, a foreign row only when it is whole."""
    return sum(1 for a, b in zip(owner_hashes, now, strict=True) if finished and a == b)


def test_an_aborted_owners_rows_read_by_the_next_request_are_foreign(tracer: Any) -> None:
    sched = _scheduler()
    slots = [3, 4, 5, 6]
    a = _req("A", 0, [11, 12, 13, 14], slots, sched)
    tracer.test_pre_alloc(sched, a)
    _write(sched, slots, 100.0)  # A's transfer landed, then A was aborted in the transfer queue: freed, never finished
    left_by_a = tracer._row_hashes(sched, slots)
    sched.token_to_kv_pool_allocator.free(torch.tensor(slots))
    assert sched.token_to_kv_pool_allocator.freed == [slots]  # the wrapper passed the free on

    b = _req("B", 1, [21, 22, 23, 24], slots, sched)
    tracer.test_pre_alloc(sched, b)  # B's transfer never wrote (the incident's stub, a lost write)
    tracer._first_decode(sched, b)
    event = next(e for e in tracer.test_events() if e["event"] == "first_decode")
    assert event["foreign_rows"] == {"A": 4} and event["foreign_from_unfinished"] == 4, event
    assert _earlier_rules_foreign(left_by_a, tracer._row_hashes(sched, slots), finished=False) == 0


def test_a_row_overwritten_only_in_part_is_foreign(tracer: Any) -> None:
    sched = _scheduler()
    slots = [8, 9, 10]
    a = _req("A", 0, [5, 6, 7], slots, sched)
    _write(sched, slots, 10.0)
    tracer._release(sched, a, slots)  # A finished
    b = _req("B", 1, [8, 9, 10], slots, sched)
    _write(sched, slots, 50.0, layers=range(0, 1))  # B's transfer wrote the first layer only
    tracer._first_decode(sched, b)
    event = next(e for e in tracer.test_events() if e["event"] == "first_decode")
    assert event["foreign_total"] == 3 and event["partial_rows"] == 3, event
    owner = [tracer._owners[s][0] for s in slots]
    assert _earlier_rules_foreign(owner, tracer._row_hashes(sched, slots), finished=True) == 0


def test_a_fully_rewritten_row_and_a_shared_first_layer_are_not_foreign(tracer: Any) -> None:
    sched = _scheduler()
    slots = [12, 13]
    a = _req("A", 0, [5, 6], slots, sched)
    _write(sched, slots, 10.0)
    tracer._release(sched, a, slots)
    b = _req("B", 1, [9, 6], slots, sched)
    _write(sched, slots, 10.0, layers=range(0, 1))  # same first-layer bytes (same token there) ...
    _write(sched, slots, 70.0, layers=range(1, LAYERS))  # ... and B's own deeper layers
    tracer._first_decode(sched, b)
    event = next(e for e in tracer.test_events() if e["event"] == "first_decode")
    assert event["foreign_total"] == 0 and event["partial_rows"] == 0, event


class PagedAllocator(Allocator):
    """SGLang 0.5.19+'s paged release shape: a request's row goes back by segments, page ids straight to
    ``_release_page_ids``, never through ``free``."""

    page_size = 2

    def __init__(self, pool: Any) -> None:
        super().__init__(pool)
        self.released_pages: list[list[int]] = []

    def free_segment(self, index: Any) -> None:
        self._release_page_ids(index[:: self.page_size] // self.page_size)

    def _release_page_ids(self, *page_ids: Any) -> None:
        self.released_pages.extend(ids.tolist() for ids in page_ids)


def test_an_aborted_owner_freed_by_page_ids_is_recorded(tracer: Any) -> None:
    sched = _scheduler()
    sched.page_size = 2
    paged = PagedAllocator(sched.token_to_kv_pool_allocator.pool)
    sched.token_to_kv_pool_allocator = paged
    slots = [4, 5, 6, 7]
    a = _req("A", 0, [11, 12, 13, 14], slots, sched)
    tracer.test_pre_alloc(sched, a)
    _write(sched, slots, 100.0)
    paged.free_segment(torch.tensor(slots))  # aborted in transfer: its row goes back by page ids
    assert paged.released_pages == [[2, 3]] and paged.freed == []  # SGLang's own release ran; free never did
    assert [(e["rid"], e["rows"]) for e in tracer.test_events() if e["event"] == "freed"] == [("A", 4)]

    b = _req("B", 1, [21, 22, 23, 24], slots, sched)
    tracer.test_pre_alloc(sched, b)
    tracer._first_decode(sched, b)
    event = next(e for e in tracer.test_events() if e["event"] == "first_decode")
    assert event["foreign_rows"] == {"A": 4} and event["foreign_from_unfinished"] == 4, event


def test_a_holder_that_never_wrote_leaves_the_earlier_writer_named(tracer: Any) -> None:
    """Z (tenant prefix P) finished in these slots; A (another prefix) held them and was aborted before its transfer
    wrote; B (prefix P, Z's tenant) got them and its own transfer wrote bytes identical to Z's. B reads no one's KV:
    the bytes A 'left' are Z's, the same KV as B's. Recording A as the writer of everything it held (the rule before)
    calls B's own rows foreign."""
    sched = _scheduler()
    slots = [20, 21, 22]
    z = _req("Z", 0, [7, 8, 9], slots, sched)
    _write(sched, slots, 30.0)
    tracer._release(sched, z, slots)
    a = _req("A", 1, [1, 2, 3], slots, sched)
    tracer.test_pre_alloc(sched, a)
    sched.token_to_kv_pool_allocator.free(torch.tensor(slots))  # aborted before any byte landed
    assert [w[0] for w in tracer._owners[20][1]] == ["Z"] * (2 * LAYERS)
    b = _req("B", 2, [7, 8, 9], slots, sched)
    _write(sched, slots, 30.0)  # B's transfer: the same KV as Z's (same prefix)
    tracer._first_decode(sched, b)
    event = next(e for e in tracer.test_events() if e["event"] == "first_decode")
    assert event["foreign_total"] == 0 and event["same_prefix_rows"] == 3, event
    holder_rule = tracer.foreign_parts((tracer._owners[20][0], (("A", -1, "freed"),) * (2 * LAYERS)),
                                       tracer._row_hashes(sched, [20])[0], "B", 0)
    assert holder_rule is not None  # the earlier rule saw A's rows in B


def test_a_request_freed_then_released_is_finished(tracer: Any) -> None:
    """SGLang frees a finished request's pages before the tracer's release record: the owner is then finished."""
    sched = _scheduler()
    slots = [24, 25]
    a = _req("A", 0, [3, 4], slots, sched)
    tracer.test_pre_alloc(sched, a)
    _write(sched, slots, 40.0)
    sched.token_to_kv_pool_allocator.free(torch.tensor(slots))
    assert {w[2] for w in tracer._owners[24][1]} == {"freed"}
    tracer._release(sched, a, slots)
    assert {w for w in tracer._owners[24][1]} == {("A", tracer.prefix_keys([3, 4], 1)[0], "finished")}
