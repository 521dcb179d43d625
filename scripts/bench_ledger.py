#!/usr/bin/env python3
"""Overhead of the page ledger + page tags, vanilla vs hardened in the same process, on real SGLang classes.

Run with a pin venv (``~/.cache/sglang-harden/venvs/<pin>/bin/python scripts/bench_ledger.py --json``; the
testbed's CPU shims on PYTHONPATH). Phases, in one process:

1. vanilla: SGLang's own ``TokenToKVPoolAllocator`` and ``MetadataBuffers`` with no hook installed;
2. hardened: ``activate()`` installs the hooks on the same classes, a decode ledger is created, and every
   transfer additionally passes the real wrappers (``send_metadata`` -> reserve + begin_write, the commit ->
   finish_write + page-tag check of the page table, the allocator free -> ledger release).

Vanilla and hardened are interleaved unit by unit (the hardened unit uses the hooked free and the ledger, the
vanilla one the unhooked function and no ledger), so machine drift hits both alike. Units:

- per transfer (decode side, N tokens): allocate N slots, receive the KV (copy N tokens x layers of K and V into
  the pool: what the transport does, here a local copy), read the metadata slot (``MetadataBuffers.get_buf``),
  later free the slots together with the ``--output-tokens`` slots the request's generated tokens took on decode
  (never tracked by the ledger), as SGLang frees a finished request; ``--kv-shape`` picks the model geometry
  (default Llama-3-8B: 32 layers x 8 KV heads x 128);
- per decode step (batch B): allocate one slot per request (``alloc``), write the KV of the new token for every
  layer, free finished requests' slots every ``--finish-every`` steps; the forward pass itself is not
  included, so the ratio is an upper bound for a real step. The hardened step also pays decode's hook on
  every scheduler loop pass (``pop_transferred``: confirmations of drained quarantine, ``loop_pass_us``).

On a shared, loaded machine the per-unit medians are noisy at the 1 % level, so the script also times the added
work alone (``hook_cost_min_us``: publish = reserve + begin_write, commit = finish_write + page tags, free of a
finished transfer's pages, free of untracked decode pages) as the minimum over rounds, and reports
``ratio_from_hook_cost`` = (vanilla unit min + added work min) / vanilla unit min (per transfer, the vanilla unit is
timed in the same rounds as the added work). ``transfer`` times the added work back to back (warm caches);
``transfer_after_kv_copy`` runs the vanilla unit's KV copy between the publish and the commit, as in a server,
so the commit and free find their code and data evicted (cold caches), and charges the hooks the interpreter's
re-entry into cold code. ``cold_marginal_min_us`` instead times each hook point cold both ways, the plain SGLang
call there and the hooked one, alternately, and takes the difference (``transfer_cold_marginal``): in a server
that re-entry is paid by whichever code runs first at that point, hooked or not.
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


class Receiver:
    def __init__(self, room: int) -> None:
        self.bootstrap_room, self.bootstrap_addr = room, "127.0.0.1:8998"
        self.bootstrap_infos = [{}]
        self.abort_notified = False
        self.kv_mgr = SimpleNamespace(record_failure=lambda *a: None)


def _newer_buffer_args() -> dict[str, Any]:
    """0.5.23's ``MetadataBuffers`` also takes ``max_sampling_mask_tokens`` (0: no sampling-mask rows)."""
    import inspect

    from sglang.srt.disaggregation.utils import MetadataBuffers

    params = inspect.signature(MetadataBuffers.__init__).parameters
    return {"max_sampling_mask_tokens": 0} if "max_sampling_mask_tokens" in params else {}


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
        self.meta = MetadataBuffers(8, hidden_size=64, hidden_states_dtype=torch.float32, **_newer_buffer_args())
        self.table = torch.zeros((4, size + 1), dtype=torch.int32)
        self.room = 1
        self.free_fn: Callable[..., Any] = TokenToKVPoolAllocator.free
        self.loop_pass: Callable[..., Any] | None = None  # decode's hook on every loop pass (set once hooked)
        self.hardened = False

    # ---- one transfer on decode
    def transfer(self) -> None:
        from sglang_harden.compat import lifecycle_v05, page_tags_v05

        n = self.args.tokens
        idx = self.alloc.alloc(n)
        generated = self.alloc.alloc(self.args.output_tokens)
        self.table[1, :n] = idx.to(torch.int32)
        self.room += 1
        if self.hardened:
            lifecycle_v05._send_metadata(lambda *a, **k: None)(Receiver(self.room), idx.numpy())
        self.kv_copy(idx)  # the bytes the transport writes
        self.meta.get_buf(0)
        if self.hardened:
            node = lifecycle_v05.NODE
            transfer = node.finish(self.room)
            req = SimpleNamespace(rid="r", origin_input_ids=range(n), req_pool_idx=1, kv=None, prefix_indices=None)
            scheduler = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=self.table))
            refused = page_tags_v05.verify_page_tags(node, scheduler, req, transfer)
            assert refused is None, refused.reason
        self.free_fn(self.alloc, torch.cat((idx, generated)))

    def kv_copy(self, idx: torch.Tensor) -> None:
        """Write one transfer's KV bytes into the pool (what evicts the caches between a transfer's hooks)."""
        for layer in range(len(self.k)):
            self.k[layer][idx] = self.src
            self.v[layer][idx] = self.src

    # ---- one decode step for a batch
    def decode_step(self, state: dict[str, Any]) -> None:
        batch = self.args.batch
        if self.hardened and self.loop_pass is not None:
            self.loop_pass(None)
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


def _interleaved(bench: Bench, unit: Callable[[], None], set_phase: Callable[[bool], None],
                 rounds: int) -> dict[str, list[float]]:
    """Time ``unit`` alternately vanilla / hardened, ``rounds`` times each: drift hits both alike."""
    samples: dict[str, list[float]] = {"vanilla": [], "hardened": []}
    for i in range(rounds * 2):
        hardened = bool(i % 2)
        set_phase(hardened)
        start = time.perf_counter()
        unit()
        samples["hardened" if hardened else "vanilla"].append(time.perf_counter() - start)
    set_phase(False)
    return samples


def _summary(samples: dict[str, list[float]]) -> dict[str, float]:
    """min (the least-disturbed run: what the code costs) and median, per variant, and their ratios."""
    v_min, h_min = min(samples["vanilla"]), min(samples["hardened"])
    v_med, h_med = statistics.median(samples["vanilla"]), statistics.median(samples["hardened"])
    return {"vanilla_min_us": round(v_min * 1e6, 1), "hardened_min_us": round(h_min * 1e6, 1),
            "ratio_min": round(h_min / v_min, 4), "vanilla_median_us": round(v_med * 1e6, 1),
            "hardened_median_us": round(h_med * 1e6, 1), "ratio_median": round(h_med / v_med, 4)}


def _hook_cost(bench: Bench, rounds: int, set_phase: Callable[[bool], None], after_transfer: bool) -> dict[str, float]:
    """The added work alone (no KV bytes), min over ``rounds``: what ledger + tags cost per transfer. Each round
    also times one vanilla transfer unit (``vanilla_transfer_us``), so a ratio compares minima taken under the
    same machine conditions (this 2-core machine drifts between runs by more than the ratio measures).
    ``after_transfer``: the vanilla unit (its KV copy) runs between the publish and the commit, as the KV bytes do
    in a server, so commit and free find their code and data evicted from the caches ("cold"); otherwise an
    untimed round of added work follows the vanilla unit and the timed round runs warm."""
    from sglang_harden.compat import lifecycle_v05, page_tags_v05

    n = bench.args.tokens
    idx = bench.alloc.alloc(n)
    generated = bench.alloc.alloc(bench.args.output_tokens)
    step_slots = bench.alloc.alloc(bench.args.batch * bench.args.finish_every)  # what a decode step's free passes
    bench.table[2, :n] = idx.to(torch.int32)  # row 1 is the vanilla unit's
    req = SimpleNamespace(rid="r", origin_input_ids=range(n), req_pool_idx=2, kv=None, prefix_indices=None)
    scheduler = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=bench.table))
    node = lifecycle_v05.NODE
    publish = lifecycle_v05._send_metadata(lambda *a, **k: None)
    loop_pass = bench.loop_pass
    assert loop_pass is not None, "hooks not installed"
    mode = lifecycle_v05.RUNTIME.config.lifecycle
    pages = idx.numpy()
    freed = torch.cat((idx, generated)).numpy()  # a finished request's slots: its transfer's and its tokens'
    decode_pages = step_slots.numpy()

    def one_round(room: int) -> tuple[float, ...]:
        receiver = Receiver(room)  # SGLang's own object: not part of the added work
        t0 = time.perf_counter()
        publish(receiver, pages)
        t1 = time.perf_counter()
        vanilla = _vanilla_transfer_s(bench, set_phase) if after_transfer else 0.0
        t2 = time.perf_counter()
        transfer = node.finish(room)
        assert page_tags_v05.verify_page_tags(node, scheduler, req, transfer) is None
        t3 = time.perf_counter()
        assert node.keep_back(freed, mode) is None
        t4 = time.perf_counter()
        node.keep_back(decode_pages, mode)
        t5 = time.perf_counter()
        loop_pass(None)
        t6 = time.perf_counter()
        return t1 - t0, t3 - t2, t4 - t3, t5 - t4, t6 - t5, vanilla

    best = [1e9] * 6
    for i in range(rounds):
        room = 10_000_000 + 2 * i
        if not after_transfer:
            vanilla = _vanilla_transfer_s(bench, set_phase)
            one_round(room + 1)  # untimed: brings the added work's code and data back into the caches
        times = list(one_round(room))
        if not after_transfer:
            times[-1] = vanilla
        best = [min(b, t * 1e6) for b, t in zip(best, times, strict=True)]
    bench.alloc.free(torch.cat((idx, generated, step_slots)))
    keys = ("publish_us", "commit_tags_us", "free_tracked_us", "free_untracked_us", "loop_pass_us",
            "vanilla_transfer_us")
    return {k: round(v, 1) for k, v in zip(keys, best, strict=True)}


def _cold_marginal(bench: Bench, rounds: int, node: Any, frees: tuple[Callable[..., Any], Callable[..., Any]]
                   ) -> dict[str, float]:
    """Each hook point with cold caches, hooked and plain call alternately, min over ``rounds`` per variant.

    Before every timed call a KV copy evicts the caches. The plain call is what SGLang runs there anyway: the
    receiver's metadata send (here a no-op), the metadata read that precedes the commit (``get_buf``) and the
    allocator's own ``free`` of the request's slots (transferred and generated). The hooked call is the same
    plus the hook (publish, finish + page tags, ledger release). Their difference is what the hook adds: the
    interpreter's re-entry into cold code, which ``transfer_after_kv_copy`` charges to the hooks, is paid here by
    whichever code runs first at that point, as in a server."""
    from sglang_harden.compat import lifecycle_v05, page_tags_v05

    n = bench.args.tokens
    vanilla_free, hooked_free = frees
    send = lambda *a, **k: None  # noqa: E731 - the receiver's own send, a stand-in
    publish = lifecycle_v05._send_metadata(send)
    scheduler = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=bench.table))
    best: dict[str, list[float]] = {k: [1e9, 1e9] for k in ("publish", "commit", "free")}

    def one(hardened: bool, room: int) -> None:
        idx = bench.alloc.alloc(n)
        generated = bench.alloc.alloc(bench.args.output_tokens)
        bench.table[3, :n] = idx.to(torch.int32)
        slots = torch.cat((idx, generated))
        pages, receiver = idx.numpy(), Receiver(room)
        req = SimpleNamespace(rid="r", origin_input_ids=range(n), req_pool_idx=3, kv=None, prefix_indices=None)
        lifecycle_v05.NODE = node if hardened else None
        bench.kv_copy(idx)
        t0 = time.perf_counter()
        (publish if hardened else send)(receiver, pages)
        t1 = time.perf_counter()
        bench.kv_copy(idx)
        t2 = time.perf_counter()
        bench.meta.get_buf(0)
        if hardened:
            assert page_tags_v05.verify_page_tags(node, scheduler, req, node.finish(room)) is None
        t3 = time.perf_counter()
        bench.kv_copy(idx)
        t4 = time.perf_counter()
        (hooked_free if hardened else vanilla_free)(bench.alloc, slots)
        t5 = time.perf_counter()
        for key, elapsed in (("publish", t1 - t0), ("commit", t3 - t2), ("free", t5 - t4)):
            best[key][hardened] = min(best[key][hardened], elapsed * 1e6)

    for i in range(rounds):
        for hardened in ((False, True) if i % 2 else (True, False)):
            one(hardened, 20_000_000 + 2 * i + hardened)
    lifecycle_v05.NODE = None
    out = {}
    for key, (plain, hooked) in best.items():
        out[f"{key}_plain_us"], out[f"{key}_hooked_us"] = round(plain, 1), round(hooked, 1)
        out[f"{key}_added_us"] = round(hooked - plain, 1)
    return out


def _per_transfer(hooks: dict[str, float]) -> float:
    return hooks["publish_us"] + hooks["commit_tags_us"] + hooks["free_tracked_us"]


def _vanilla_transfer_s(bench: Bench, set_phase: Callable[[bool], None]) -> float:
    set_phase(False)
    start = time.perf_counter()
    bench.transfer()
    elapsed = time.perf_counter() - start
    set_phase(True)
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256, help="tokens per transfer")
    parser.add_argument("--output-tokens", type=int, default=16, help="tokens each transferred request generates")
    parser.add_argument("--batch", type=int, default=16, help="requests per decode step")
    parser.add_argument("--finish-every", type=int, default=8)
    parser.add_argument("--pool-tokens", type=int, default=4096)
    parser.add_argument("--kv-shape", type=int, nargs=3, default=(32, 8, 128), metavar=("LAYERS", "HEADS", "DIM"))
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--hook-rounds", type=int, default=300, help="rounds for the added-work minimum")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    import sglang

    bench = Bench(args)
    from sglang_harden.compat import activate, lifecycle_v05
    from sglang_harden.compat.lifecycle_v05 import DecodeNode

    vanilla_free = bench.free_fn
    activate("bench")
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    hooked_free = TokenToKVPoolAllocator.free
    assert hooked_free is not vanilla_free, "hooks not installed"
    node = DecodeNode.for_allocator(bench.alloc, cap=0)
    bench.loop_pass = lifecycle_v05._confirmations_first(lambda *a, **k: None)

    def set_phase(hardened: bool) -> None:
        bench.hardened = hardened
        bench.free_fn = hooked_free if hardened else vanilla_free
        lifecycle_v05.NODE = node if hardened else None

    bench.transfer()  # warm-up (allocator sorting, page faults)
    transfer = _interleaved(bench, bench.transfer, set_phase, args.rounds)
    state: dict[str, Any] = {"held": [], "step": 0}
    step = _interleaved(bench, lambda: bench.decode_step(state), set_phase, args.rounds * 4)
    if state["held"]:
        vanilla_free(bench.alloc, torch.cat(state["held"]))
    lifecycle_v05.NODE = node
    hooks = _hook_cost(bench, args.hook_rounds, set_phase, after_transfer=False)
    cold = _hook_cost(bench, args.hook_rounds, set_phase, after_transfer=True)
    marginal = _cold_marginal(bench, args.hook_rounds, node, (vanilla_free, hooked_free))
    lifecycle_v05.NODE = None
    assert node.ledger.quarantined_count() == 0
    assert int(np.count_nonzero(node.states)) == 0, "every page back to FREE in the ledger"

    out: dict[str, Any] = {"sglang": sglang.__version__, "tokens_per_transfer": args.tokens, "batch": args.batch,
                           "kv_shape": list(args.kv_shape), "rounds": args.rounds,
                           "transfer": _summary(transfer), "decode_step": _summary(step), "hook_cost_min_us": hooks}
    v_transfer, v_step = hooks.pop("vanilla_transfer_us"), min(step["vanilla"]) * 1e6
    v_cold = cold.pop("vanilla_transfer_us")
    out["vanilla_transfer_min_us_same_phase"] = v_transfer
    out["hook_cost_after_transfer_min_us"] = cold
    out["cold_marginal_min_us"] = marginal
    added_cold = sum(marginal[f"{key}_added_us"] for key in ("publish", "commit", "free"))
    added_step = hooks["free_untracked_us"] / args.finish_every + hooks["loop_pass_us"]
    out["ratio_from_hook_cost"] = {"transfer": round((v_transfer + _per_transfer(hooks)) / v_transfer, 5),
                                   "transfer_after_kv_copy": round((v_cold + _per_transfer(cold)) / v_cold, 5),
                                   "transfer_cold_marginal": round((v_cold + added_cold) / v_cold, 5),
                                   "decode_step": round((v_step + added_step) / v_step, 5)}
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
