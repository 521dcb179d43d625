"""What the PD-pair benchmarks in ``scripts/`` share: their command line, the request loop and the entry point.

Each benchmark starts pairs of one pin one at a time (idle SGLang servers poll busily, so pairs side by side
slow each other down), sends the same greedy requests to each and reports per-request latency; what it measures
besides, and how it reports, is its own.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from sglang_harden.testbed.client import greedy_body
from sglang_harden.testbed.incident import tenant_a_prompt
from sglang_harden.testbed.pd_topology import PDPair

POOL_TOKENS = 2048
CONTEXT_LENGTH = 1024


def parser(description: str, requests_help: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--pin", default="0.5.19")
    p.add_argument("--backend", default="mooncake", choices=["mooncake", "nixl"])
    p.add_argument("--prompt-tokens", type=int, default=400)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--requests", type=int, default=30, help=requests_help)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--passes", type=int, default=1)
    p.add_argument("--server-flag", action="append", default=[], dest="server_flags", metavar="FLAG",
                   help="extra flag for every server of every variant (repeat), e.g. --server-flag=--sleep-on-idle")
    p.add_argument("--json", action="store_true")
    return p


def make_pair(args: argparse.Namespace, launcher: str, env: dict[str, str], log_dir: Path) -> PDPair:
    """A pair of ``args.pin`` (not started) with the benchmarks' pool and context sizes."""
    return PDPair(
        args.pin,
        prefill_max_total_tokens=POOL_TOKENS,
        decode_max_total_tokens=POOL_TOKENS,
        context_length=CONTEXT_LENGTH,
        transfer_backend=args.backend,
        env=env,
        launcher_module=launcher,
        log_dir=log_dir,
        prefill_flags=args.server_flags,
        decode_flags=args.server_flags,
    )


def send(pair: PDPair, name: str, args: argparse.Namespace, first: int, count: int) -> list[float]:
    """End-to-end seconds of ``count`` greedy requests (prompts ``first`` ...), one after the other; a failed
    request stops the benchmark."""
    times: list[float] = []
    for i in range(first, first + count):
        body = greedy_body(tenant_a_prompt(1000 + i, args.prompt_tokens), args.new_tokens, rid=None)
        result = pair.generate(body, timeout=120)
        if not (result.prefill.ok and result.decode.ok):
            raise RuntimeError(f"{name}: request {i} failed: {result.decode.summary()}")
        times.append(result.decode.elapsed_s)
    return times


def run_summary(args: argparse.Namespace, times: dict[str, list[float]]) -> dict[str, object]:
    """A report's first fields: how the benchmark ran, and each variant's median and minimum latency."""
    return {
        "pin": args.pin,
        "backend": args.backend,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "requests": args.requests,
        "passes": args.passes,
        "server_flags": args.server_flags,
        "median_s": {name: round(statistics.median(t), 4) for name, t in times.items()},
        "min_s": {name: round(min(t), 4) for name, t in times.items()},
    }


def main(args: argparse.Namespace, log_prefix: str, run: Callable[[Path], dict[str, object]]) -> int:
    """Run ``run(log_root)`` and print its report (JSON with ``--json``); SIGTERM stops the running pair."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    log_root = Path(tempfile.mkdtemp(prefix=log_prefix))
    result = run(log_root)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>20}: {value}")
    return 0
