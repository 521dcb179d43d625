#!/usr/bin/env python3
"""The guards' hot-path code on device tensors, hook by hook: no host synchronisation, the time each costs the
scheduler thread, while a "forward" keeps the GPU busy. No SGLang needed (stand-ins hold what the hooks read).

    python3 scripts/gpu_hooks_check.py --json out.json            # on a GPU: CUDA tensors
    python3 scripts/gpu_hooks_check.py --cpu-dry-run --json out.json  # anywhere: the testbed's CUDA simulator

On a GPU every step runs under ``torch.cuda.set_sync_debug_mode("error")`` (any synchronising CUDA call raises)
while ``torch.cuda._sleep`` on the current stream stands for the forward in flight; the answers the steps wait for
are polled (``query()``), never waited on. With ``--cpu-dry-run`` the same steps run on CPU tensors the simulator
treats as device tensors, and its counter must see no host sync by sglang-harden. Steps:

- ``stamp``: the canary stamps of a request's pages (pinned upload, private stream);
- ``gate``: the commit gate's canary and page-tag steps launched and decided once landed (one clean transfer);
- ``digest``: a rank's digest of a request's rows launched and finalised once landed, bit for bit the numpy
  reference's;
- ``learn``: the page ledger learning of a free from a copy to pinned memory;
- ``release``: a committed request's free passing the free path, and an in-flight one's kept back whole.

Prints one JSON report: per step the host microseconds (median of ``--reps``), and ``ok``; exit 0 only if every step
ran without a synchronisation and decided correctly.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from sglang_harden.compat.free_context import REQUEST, FreeContext, within  # noqa: E402
from sglang_harden.compat.gate import CommitGate, GateWiring  # noqa: E402
from sglang_harden.guards import canary  # noqa: E402
from sglang_harden.kernels import canary_stamps  # noqa: E402
from sglang_harden.kernels.device import HostCopy  # noqa: E402
from sglang_harden.kernels.digest_launch import launch_digest  # noqa: E402
from sglang_harden.kernels.digest_ref import digest_numpy  # noqa: E402
from sglang_harden.kernels.digest_spec import KVLayout  # noqa: E402
from sglang_harden.kernels.digest_torch import digest_torch, sums_torch  # noqa: E402

SUCCESS, TRANSFERRING, FAILED = 4, 3, 0
SLEEP_CYCLES = 50_000_000  # ~25-40 ms of "forward" on an H100/H200


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-dry-run", action="store_true", help="CPU tensors under the CUDA simulator")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--pages", type=int, default=64, help="pages per request")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


class Device:
    """Where the steps run: a CUDA device under sync-debug "error" with a busy stream, or the simulator."""

    def __init__(self, dry_run: bool) -> None:
        self.dry_run = dry_run
        self._session: Any = None
        if dry_run:
            from sglang_harden.testbed import cudasim

            self._cudasim = cudasim
            self._session = cudasim.session()
            self.device: Any = self._session.__enter__()
        else:
            if not torch.cuda.is_available():
                raise SystemExit("no CUDA device (use --cpu-dry-run)")
            self.device = torch.device("cuda", 0)

    def close(self) -> None:
        if self._session is not None:
            self._session.__exit__(None, None, None)

    @contextlib.contextmanager
    def strict(self) -> Iterator[None]:
        """A step's window: the GPU kept busy, any host synchronisation an error (GPU) or counted (simulator)."""
        if self.dry_run:
            self._cudasim.reset()
            yield
            syncs = {key: n for key, n in self._cudasim.counts()["syncs"].items() if key[0] == "sglang_harden"}
            if syncs:
                raise AssertionError(f"host synchronisations by sglang-harden: {syncs}")
            return
        torch.cuda._sleep(SLEEP_CYCLES)
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")


def poll(ready: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError("a copy never landed")
        time.sleep(0.0002)


def _pool(dev: Any, args: argparse.Namespace) -> SimpleNamespace:
    tokens = args.pages * args.page_size * 2
    shape = (tokens, 2, 64)
    k = [torch.zeros(shape, dtype=torch.bfloat16, device=dev) for _ in range(args.layers)]
    v = [torch.zeros(shape, dtype=torch.bfloat16, device=dev) for _ in range(args.layers)]
    return SimpleNamespace(k_buffer=k, v_buffer=v, page_size=args.page_size)


def step_stamp(env: Device, pool: Any, pages: list[int]) -> Callable[[], bool]:
    def run() -> bool:
        slots = canary.stamp_slots(pages, pool.page_size)
        with env.strict():
            canary_stamps.stamp(canary_stamps.canary_buffers(pool), slots, canary.new_marker())
        return True

    return run


def step_gate(env: Device, pool: Any, pages: list[int]) -> Callable[[], bool]:
    stamps = canary_stamps.Stamps()
    step = canary_stamps.CanaryGateStep(stamps, lambda: pool)

    def run() -> bool:
        room = 7
        marker = canary.new_marker()
        buffers = canary_stamps.canary_buffers(pool)
        slots = canary_stamps.stamp(buffers, canary.stamp_slots(pages, pool.page_size), marker)
        stamps.add(room, canary_stamps.Stamp(marker, tuple(pages), slots))
        for buffer in buffers:  # "the transfer" writes every page
            buffer[torch.as_tensor(canary.stamp_slots(pages, pool.page_size), device=buffer.device)] = 1
        gate = CommitGate(GateWiring(SUCCESS, TRANSFERRING, FAILED, lambda req: False,
                                     lambda decision, guard, room, rid: not decision.allows))
        gate.join("canary", step, "canary")
        receiver = SimpleNamespace(bootstrap_room=room, kv_mgr=SimpleNamespace(record_failure=lambda *a: None))
        queue = SimpleNamespace(queue=[SimpleNamespace(req=SimpleNamespace(rid="r", bootstrap_room=room),
                                                       kv_receiver=receiver)])
        status = TRANSFERRING
        with env.strict():
            for _ in range(100_000):
                gate.see_queue(queue)
                status = gate.gate(receiver, SUCCESS)
                if status != TRANSFERRING:
                    break
                time.sleep(0.0002)
        return status == SUCCESS

    return run


def step_digest(env: Device, pool: Any, pages: list[int]) -> Callable[[], bool]:
    layout = KVLayout(dtype="bfloat16", head_dim=64, itemsize=2, num_layers=len(pool.k_buffer), kv_halves=2,
                      total_kv_heads=2, head_start=0, num_heads=2, page_size=pool.page_size)
    for buffers in (pool.k_buffer, pool.v_buffer):
        for layer in buffers:
            layer.copy_(torch.randn(layer.shape, generator=torch.Generator().manual_seed(3)).to(layer.dtype))
    slots_host = np.array([p * pool.page_size + t for p in pages for t in range(pool.page_size)], dtype=np.int64)
    k_np = [b.cpu().view(torch.int16).numpy().view(np.uint16) for b in pool.k_buffer]
    v_np = [b.cpu().view(torch.int16).numpy().view(np.uint16) for b in pool.v_buffer]
    reference = digest_numpy(k_np, v_np, slots_host, layout, 0)
    slots = torch.from_numpy(slots_host).to(pool.k_buffer[0].device)

    def run() -> bool:
        with env.strict():
            pending = launch_digest(pool.k_buffer, pool.v_buffer, slots, layout, 0, 0, on_host=digest_torch,
                                    on_device=sums_torch)
            poll(pending.ready)
            digests = pending.shard().digests
        return digests == reference

    return run


def step_learn(env: Device, pool: Any, pages: list[int]) -> Callable[[], bool]:
    index = torch.tensor(pages, dtype=torch.int64, device=pool.k_buffer[0].device)

    def run() -> bool:
        with env.strict():
            copy = HostCopy.launch([index])
            poll(copy.ready)
            learned = copy.numpy().tolist()
        return learned == pages

    return run


def step_release(env: Device, pool: Any, pages: list[int]) -> Callable[[], bool]:
    from sglang_harden.compat.free_context import HOLD, PASS, route

    transfers = {101: "in flight"}
    node = SimpleNamespace(in_flight=lambda room: transfers.get(room), any_in_flight=lambda: True, page_size=1)

    def run() -> bool:
        with env.strict():
            held = within(FreeContext(REQUEST, SimpleNamespace(bootstrap_room=101)), lambda: route(node))
            passed = within(FreeContext(REQUEST, SimpleNamespace(bootstrap_room=102)), lambda: route(node))
        return held == HOLD and passed == PASS

    return run


STEPS = {"stamp": step_stamp, "gate": step_gate, "digest": step_digest, "learn": step_learn, "release": step_release}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = Device(args.cpu_dry_run)
    report: dict[str, Any] = {"device": "cpu (CUDA simulator)" if args.cpu_dry_run else torch.cuda.get_device_name(0),
                              "reps": args.reps, "pages": args.pages, "page_size": args.page_size, "steps": {}}
    status = 0
    try:
        pool = _pool(env.device, args)
        pages = list(range(1, args.pages + 1))
        for name, make in STEPS.items():
            run = make(env, pool, pages)
            times, ok, error = [], True, ""
            try:
                for _ in range(args.reps):
                    began = time.perf_counter()
                    ok = run() and ok
                    times.append((time.perf_counter() - began) * 1e6)
            except Exception as exc:  # noqa: BLE001 - a step that synchronised or failed is reported, not fatal
                ok, error = False, repr(exc)
            report["steps"][name] = {"ok": ok, "host_us_median": round(statistics.median(times), 1) if times else None,
                                     "error": error}
            status |= 0 if ok else 1
    finally:
        env.close()
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return status


if __name__ == "__main__":
    sys.exit(main())
