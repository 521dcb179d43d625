"""Rank agreement of the checksum guard across real processes, within a bounded time.

Three decode "ranks" (processes) each hold 2 of 6 KV heads and compare against one prefill shard that
published all 6 (prefill TP 1, decode TP 3). They agree over torch.distributed gloo on 127.0.0.1 when torch is
installed, and always over multiprocessing queues. Each exchange carries a batch of two requests. Asserted: one
rank's mismatch aborts that request on every rank while the clean one is allowed everywhere; a rank that stalls
or dies makes the others abort within the bound.

Runs under the system python (queue transport only) and under a pin venv's python (both transports).
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import queue
import socket
import time
from datetime import timedelta
from typing import Any

import numpy as np
import pytest

from sglang_harden.guards.checksum import QueueTransport, agree_across_ranks, compare
from sglang_harden.kernels.digest_ref import digest_numpy
from sglang_harden.kernels.digest_spec import KVLayout, ShardDigest, token_slots

WORLD = 3
HEADS_PER_RANK = 2
BOUND_S = 8.0
SLACK_S = 4.0  # two shared CPU cores: generous, but far below a hang
STALL_S = 120.0
STARTUP_S = 300.0  # spawning torch processes on a loaded 2-core machine; not part of the bound

HAVE_TORCH = importlib.util.find_spec("torch") is not None
TRANSPORTS = ["queue", "gloo"] if HAVE_TORCH else ["queue"]


def _layout(start: int, heads: int) -> KVLayout:
    return KVLayout("bfloat16", 16, 2, 2, 2, WORLD * HEADS_PER_RANK, start, heads, 4)


def _pool(seed: int = 1234) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    shape = (32, WORLD * HEADS_PER_RANK, 16)
    return (
        [rng.integers(0, 2**16, shape, dtype=np.uint16) for _ in range(2)],
        [rng.integers(0, 2**16, shape, dtype=np.uint16) for _ in range(2)],
    )


def _local_decision(rank: int, corrupt: bool, rid: str) -> Any:
    k, v = _pool()
    slots = token_slots([5, 1, 3], 4, 10)
    full = _layout(0, WORLD * HEADS_PER_RANK)
    prefill = ShardDigest(full, 0, len(slots), digest_numpy(k, v, slots, full), rank=0)
    lo = rank * HEADS_PER_RANK
    mine_k = [b[:, lo : lo + HEADS_PER_RANK].copy() for b in k]
    mine_v = [b[:, lo : lo + HEADS_PER_RANK].copy() for b in v]
    if corrupt:
        mine_v[1][slots[7], 1, 3] ^= 1
    shard = _layout(lo, HEADS_PER_RANK)
    decode = ShardDigest(shard, 0, len(slots), digest_numpy(mine_k, mine_v, slots, shard), rank=rank)
    return compare([prefill], decode, rid=rid)


def _worker(
    rank: int, transport_name: str, scenario: str, port: int, inboxes: list, barrier: Any, results: Any
) -> None:
    if transport_name == "gloo":
        import torch.distributed as dist

        from sglang_harden.compat.digest_pool import TorchGroupTransport

        # the rendezvous may take long on a loaded machine; the agreement bound is the wait() timeout
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD,
            timeout=timedelta(seconds=STARTUP_S),
        )
        transport: Any = TorchGroupTransport()
    else:
        transport = QueueTransport(rank, inboxes)
    # one exchange for the batch of requests committing this step: a clean one and one rank 1 received bad
    local = [
        _local_decision(rank, corrupt=False, rid="req-clean"),
        _local_decision(rank, corrupt=rank == 1, rid="req-bad"),
    ]
    barrier.wait(timeout=STARTUP_S)  # all ranks are up; from here on only the agreement bound counts
    if rank == WORLD - 1 and scenario == "stall":
        time.sleep(STALL_S)
    if rank == WORLD - 1 and scenario == "die":
        os._exit(3)
    start = time.monotonic()
    agreed = agree_across_ranks(local, transport, BOUND_S, rids=["req-clean", "req-bad"])
    elapsed = time.monotonic() - start
    results.put(
        (rank, [d.verdict.value for d in local], [d.verdict.value for d in agreed], elapsed, [d.reason for d in agreed])
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(transport_name: str, scenario: str, expect: int) -> list[tuple]:
    # queues: fork is cheap and safe (nothing heavy imported); gloo: spawn, torch is imported in the child
    ctx = mp.get_context("fork" if transport_name == "queue" else "spawn")
    inboxes = [ctx.Queue() for _ in range(WORLD)]
    results = ctx.Queue()
    barrier = ctx.Barrier(WORLD)
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, transport_name, scenario, port, inboxes, barrier, results), daemon=True)
        for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    got: list[tuple] = []
    deadline = time.monotonic() + STARTUP_S + BOUND_S + SLACK_S
    try:
        while len(got) < expect:
            got.append(results.get(timeout=max(0.1, deadline - time.monotonic())))
    except queue.Empty:
        pass
    finally:
        for p in procs:
            p.join(timeout=2)
            if p.is_alive():  # the stalled rank, or a straggler after the deadline
                p.kill()
                p.join(timeout=10)
    assert len(got) == expect, f"only {len(got)} of {expect} ranks reported: {got}"
    return sorted(got)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_one_rank_mismatch_aborts_that_request_on_all_ranks(transport: str) -> None:
    got = _run(transport, "batch", WORLD)
    assert [g[1] for g in got] == [["allow", "allow"], ["allow", "abort"], ["allow", "allow"]]
    assert [g[2] for g in got] == [["allow", "abort"]] * WORLD  # the clean request is not collateral
    assert all(g[3] < BOUND_S + SLACK_S for g in got), got
    assert "KV heads [3]" in got[1][4][1] and "rank(s) [1]" in got[0][4][1]


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("scenario", ["stall", "die"])
def test_missing_rank_aborts_the_others_within_the_bound(transport: str, scenario: str) -> None:
    got = _run(transport, scenario, WORLD - 1)
    assert [g[0] for g in got] == list(range(WORLD - 1))
    assert [g[2] for g in got] == [["abort", "abort"]] * (WORLD - 1)
    assert all(g[3] < BOUND_S + SLACK_S for g in got), got
