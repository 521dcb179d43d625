#!/usr/bin/env python3
"""Digest throughput against a plain copy of the same bytes, measured in the same run.

For one request's KV (every layer, K and V, pages in send order) it times, interleaved rep by rep:

* ``copy``   - a contiguous memcpy of as many rows of each layer buffer (the fastest way to move the bytes),
* ``gather`` - copying the request's pages out of the pool into a staging buffer (what a sender does),
* ``digest`` - the per-KV-head digest: torch on CPU, Triton (and torch) on CUDA.

and reports bytes/s and the ratios digest/copy and digest/gather (median over reps of per-rep ratios, so
noise from other processes on the machine hits both sides of a ratio alike). Target: digest/copy >= 0.5.

    python scripts/bench_digest.py                 # CPU table
    python scripts/bench_digest.py --json          # machine-readable
    python scripts/bench_digest.py --device cuda   # Triton + torch on the GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from sglang_harden.kernels.digest_native import digest_native, native_library, native_status  # noqa: E402
from sglang_harden.kernels.digest_spec import KVLayout, token_slots  # noqa: E402
from sglang_harden.kernels.digest_torch import digest_torch  # noqa: E402

DTYPES = {
    "bf16": (torch.bfloat16, "bfloat16"),
    "fp16": (torch.float16, "float16"),
    "fp8": (torch.uint8, "float8_e4m3fn"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--layers", type=int, default=None, help="default 8 on CPU, 32 on CUDA")
    p.add_argument("--heads", type=int, default=8, help="KV heads on this rank")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--tokens", type=int, default=None, help="default 2048 on CPU, 8192 on CUDA")
    p.add_argument("--page-sizes", default="1,64", help="comma-separated")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave torch's default)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    return p.parse_args(argv)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def build(args: argparse.Namespace, device: torch.device, page: int) -> dict:
    storage, name = DTYPES[args.dtype]
    itemsize = torch.empty(0, dtype=storage).element_size()
    layout = KVLayout(name, args.head_dim, itemsize, args.layers, 2, args.heads, 0, args.heads, page)
    pool_tokens = 2 * args.tokens + page
    gen = torch.Generator().manual_seed(page)

    def layer() -> torch.Tensor:
        raw = torch.randint(
            -(2**31), 2**31 - 1, (pool_tokens, args.heads, layout.row_bytes // 4), dtype=torch.int32, generator=gen
        )
        return raw.view(storage).reshape(pool_tokens, args.heads, args.head_dim).to(device)

    k = [layer() for _ in range(args.layers)]
    v = [layer() for _ in range(args.layers)]
    pages = torch.randperm(pool_tokens // page, generator=gen)[: -(-args.tokens // page)].tolist()
    slots = torch.tensor(token_slots(pages, page, args.tokens), dtype=torch.int64, device=device)
    nbytes = 2 * args.layers * args.tokens * layout.row_bytes * args.heads
    return {"layout": layout, "k": k, "v": v, "slots": slots, "bytes": nbytes}


def candidates(case: dict, device: torch.device) -> dict[str, Callable[[], object]]:
    k, v, slots, layout = case["k"], case["v"], case["slots"], case["layout"]
    n = slots.numel()
    staging = [torch.empty((n, *b.shape[1:]), dtype=b.dtype, device=device) for b in k + v]

    def copy() -> None:
        for out, buf in zip(staging, k + v, strict=True):
            out.copy_(buf[:n])

    def gather() -> None:
        for out, buf in zip(staging, k + v, strict=True):
            torch.index_select(buf, 0, slots, out=out)

    fns: dict[str, Callable[[], object]] = {"copy": copy, "gather": gather}
    if device.type == "cpu" and native_library() is not None:
        fns["digest_native"] = lambda: digest_native(k, v, slots, layout)
    fns["digest_torch"] = lambda: digest_torch(k, v, slots, layout)
    if device.type == "cuda":
        from sglang_harden.kernels.digest_triton import TritonDigester

        digester = TritonDigester(k, v, layout)
        fns["digest_triton"] = lambda: digester.sums(slots)
    return fns


def measure(fns: dict[str, Callable[[], object]], device: torch.device, reps: int) -> dict[str, list[float]]:
    for fn in fns.values():  # warm-up: allocation, Triton compile, caches
        timed(fn, device)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(timed(fn, device))
    return times


def summarise(case: dict, times: dict[str, list[float]]) -> dict:
    nbytes = case["bytes"]
    rates = {name: nbytes / statistics.median(ts) for name, ts in times.items()}
    out: dict[str, object] = {"bytes": nbytes, "GBps": {n: round(r / 1e9, 3) for n, r in rates.items()}}
    for name in (n for n in times if n.startswith("digest")):
        for base in ("copy", "gather"):
            per_rep = [b / d for d, b in zip(times[name], times[base], strict=True)]
            out[f"{name}/{base}"] = round(statistics.median(per_rep), 3)
    return out


def run(args: argparse.Namespace) -> dict:
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    args.layers = args.layers or (32 if cuda else 8)
    args.tokens = args.tokens or (8192 if cuda else 2048)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    for page in (int(p) for p in args.page_sizes.split(",")):
        case = build(args, device, page)
        summary = summarise(case, measure(candidates(case, device), device, args.reps))
        results.append({"page_size": page, **summary})
    return {
        "device": torch.cuda.get_device_name(device) if cuda else f"cpu x{torch.get_num_threads()} threads",
        "torch": torch.__version__,
        "native_digest": native_status()[1],
        "config": {k: getattr(args, k) for k in ("layers", "heads", "head_dim", "dtype", "tokens", "reps")},
        "results": results,
    }


def print_table(report: dict) -> None:
    cfg = report["config"]
    print(f"device: {report['device']}  torch {report['torch']}  {cfg}")
    for res in report["results"]:
        mib = res["bytes"] / 2**20
        print(f"\npage_size={res['page_size']}  request KV={mib:.1f} MiB")
        print(f"  {'path':<16}{'GB/s':>9}{'vs copy':>10}{'vs gather':>11}")
        for name, rate in res["GBps"].items():
            vs_copy = res.get(f"{name}/copy", "")
            vs_gather = res.get(f"{name}/gather", "")
            print(f"  {name:<16}{rate:>9.3f}{vs_copy!s:>10}{vs_gather!s:>11}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
