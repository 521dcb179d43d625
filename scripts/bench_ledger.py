#!/usr/bin/env python3
"""Overhead of the page ledger + page tags, vanilla vs hardened in the same process, on real SGLang classes.

Run with a pin venv (``~/.cache/sglang-harden/venvs/<pin>/bin/python scripts/bench_ledger.py --json``; the
testbed's CPU shims on PYTHONPATH). Phases, in one process:

1. vanilla: SGLang's own ``TokenToKVPoolAllocator`` and ``MetadataBuffers`` with no hook installed;
2. hardened: ``activate()`` installs the hooks on the same classes, a decode ledger is created, and every
   transfer additionally passes the real wrappers (``send_metadata`` -> reserve + begin_write, the commit ->
   finish_write + page-tag check of the page table, the allocator free -> ledger release).

Units measured (median of ``--repeat`` rounds, each round interleaving vanilla and hardened work is impossible
because hooks patch classes, so rounds alternate phases by toggling the ledger; the vanilla numbers come from
the unhooked functions kept as ``__wrapped__``):

- per transfer (decode side, N tokens): allocate N slots, receive the KV (copy N tokens x layers of K and V into
  the pool: what the transport does, here a local copy), read the metadata slot (``MetadataBuffers.get_buf``),
  later free the slots; ``--kv-shape`` picks the model geometry (default Llama-3-8B: 32 layers x 8 KV heads x 128);
- per decode step (batch B): allocate one slot per request (``alloc``), write the KV of the new token for every
  layer, free a finished request's slots (one request in ``--finish-every`` steps); the forward pass itself is
  not included, so the ratio is an upper bound for a real step.

Prints the absolute added time (microseconds) and the ratio hardened / vanilla for both units.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402


def _timeit(fn: Callable[[], None], repeat: int, inner: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


class Receiver:
    def __init__(self, room: int) -> None:
        self.bootstrap_room, self.bootstrap_addr = room, "127.0.0.1:8998"
        self.bootstrap_infos = [{}]
        self.abort_notified = False
        self.kv_mgr = SimpleNamespace(record_failure=lambda *a: None)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        from sglang.srt.disaggregation.utils import MetadataBuffers
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

        self.args = args
        layers, heads, dim = args.kv_shape
        size = args.pool_tokens
        self.alloc = TokenToKVPoolAllocator(size, torch.bfloat16, "cpu", None, True)
        self.k = [torch.zeros((size + 1, heads, dim), dtype=torch.bfloat16) for _ in range(layers)]
        self.v = [torch.zeros((size + 1, heads, dim), dtype=torch.bfloat16) for _ in range(layers)]
        self.src = torch.randn((args.tokens, heads, dim)).to(torch.bfloat16)
        self.meta = MetadataBuffers(8, hidden_size=64, hidden_states_dtype=torch.float32)
        self.table = torch.zeros((4, size + 1), dtype=torch.int32)
        self.room = 1
        self.free_fn: Callable[..., Any] = TokenToKVPoolAllocator.free
        self.hardened = False

    # ---- one transfer on decode
    def transfer(self) -> None:
        from sglang_harden.compat import lifecycle_v05

        n = self.args.tokens
        idx = self.alloc.alloc(n)
        self.table[1, :n] = idx.to(torch.int32)
        self.room += 1
        if self.hardened:
            lifecycle_v05._send_metadata(lambda *a, **k: None)(Receiver(self.room), idx.numpy())
        for layer in range(len(self.k)):  # the bytes the transport writes
            self.k[layer][idx] = self.src
            self.v[layer][idx] = self.src
        self.meta.get_buf(0)
        if self.hardened:
            node = lifecycle_v05.NODE
            transfer = node.finish(self.room)
            req = SimpleNamespace(rid="r", origin_input_ids=range(n), req_pool_idx=1, kv=None, prefix_indices=None)
            scheduler = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=self.table))
            decision = lifecycle_v05.check_request_pages(node, scheduler, req, transfer)
            assert decision.allows, decision.reason
        self.free_fn(self.alloc, idx)

    # ---- one decode step for a batch
    def decode_step(self, state: dict[str, Any]) -> None:
        batch = self.args.batch
        idx = self.alloc.alloc(batch)
        new = self.src[:batch]
        for layer in range(len(self.k)):
            self.k[layer][idx] = new
            self.v[layer][idx] = new
        state["held"].append(idx)
        state["step"] += 1
        if state["step"] % self.args.finish_every == 0:
            self.free_fn(self.alloc, torch.cat(state["held"]))
            state["held"] = []

    def measure(self) -> dict[str, float]:
        a = self.args
        t_transfer = _timeit(self.transfer, a.repeat, a.inner)
        state: dict[str, Any] = {"held": [], "step": 0}
        t_step = _timeit(lambda: self.decode_step(state), a.repeat, a.inner * 4)
        if state["held"]:
            self.free_fn(self.alloc, torch.cat(state["held"]))
        return {"transfer_s": t_transfer, "decode_step_s": t_step}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512, help="tokens per transfer")
    parser.add_argument("--batch", type=int, default=32, help="requests per decode step")
    parser.add_argument("--finish-every", type=int, default=8)
    parser.add_argument("--pool-tokens", type=int, default=4096)
    parser.add_argument("--kv-shape", type=int, nargs=3, default=(32, 8, 128), metavar=("LAYERS", "HEADS", "DIM"))
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--inner", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    import sglang

    bench = Bench(args)
    bench.measure()  # warm-up (allocator sorting, page faults)
    rounds: dict[str, list[dict[str, float]]] = {"vanilla": [], "hardened": []}

    from sglang_harden.compat import activate, lifecycle_v05
    from sglang_harden.compat.lifecycle_v05 import DecodeNode

    vanilla_free = bench.free_fn
    activate("bench")
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    hooked_free = TokenToKVPoolAllocator.free
    assert hooked_free is not vanilla_free, "hooks not installed"
    node = DecodeNode.for_allocator(bench.alloc, cap=0)
    for _ in range(3):  # alternate phases so drift from the shared machine hits both alike
        bench.hardened, bench.free_fn, lifecycle_v05.NODE = False, vanilla_free, None
        rounds["vanilla"].append(bench.measure())
        bench.hardened, bench.free_fn, lifecycle_v05.NODE = True, hooked_free, node
        rounds["hardened"].append(bench.measure())
    lifecycle_v05.NODE = None
    assert node.ledger.quarantined_count() == 0
    assert int(np.count_nonzero(node.states)) == 0, "every page back to FREE in the ledger"

    def med(variant: str, key: str) -> float:
        return statistics.median(r[key] for r in rounds[variant])

    out: dict[str, Any] = {"sglang": sglang.__version__, "tokens_per_transfer": args.tokens, "batch": args.batch,
                           "kv_shape": list(args.kv_shape), "threads": torch.get_num_threads()}
    for key in ("transfer_s", "decode_step_s"):
        v, h = med("vanilla", key), med("hardened", key)
        unit = key.removesuffix("_s")
        out[unit] = {"vanilla_us": round(v * 1e6, 1), "hardened_us": round(h * 1e6, 1),
                     "added_us": round((h - v) * 1e6, 1), "ratio": round(h / v, 4)}
    if args.json:
        print(json.dumps(out))
    else:
        for unit in ("transfer", "decode_step"):
            r = out[unit]
            print(f"{unit:12} vanilla {r['vanilla_us']:>10} us  hardened {r['hardened_us']:>10} us  "
                  f"added {r['added_us']:>8} us  ratio {r['ratio']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
