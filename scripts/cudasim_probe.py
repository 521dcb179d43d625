#!/usr/bin/env python3
"""Host syncs and poisoned reads per request under the CUDA simulator, vanilla vs hardened, per pin (test-only).

    python scripts/cudasim_probe.py --pin 0.5.23 --pin 0.5.19 --requests 10 --json out.json

Each (pin, variant) runs on a fresh real CPU PD pair (profile ``paged16`` unless ``--profile``), one pair at a
time, always stopped. The pair runs with the pin's shims (``cuda_sim`` among them, ci/pins.toml); each server's
``/server_info`` ``testbed_cudasim`` block is read before and after the requests, and the difference divided by the
number of requests is what one request costs on that role: per (owner, kind, site), and poisoned reads per
(owner, op, site). Also reported: ready time of each server (wall, and CPU seconds of its processes), per-request
latency and CPU seconds per request of each server, the greedy output ids.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_harden.testbed.client import greedy_body  # noqa: E402
from sglang_harden.testbed.cudasim_report import per_request, sim_state  # noqa: E402
from sglang_harden.testbed.pd_topology import PDPair  # noqa: E402
from sglang_harden.testbed.profiles import get_profile  # noqa: E402
from sglang_harden.testbed.server import HARDENED_LAUNCHER, VANILLA_LAUNCHER  # noqa: E402


def group_cpu_s(pgid: int | None) -> float:
    """CPU seconds (user + system) used so far by the live processes of a process group (the server's tokenizer
    manager, scheduler and detokenizer): unlike wall time, barely moved by other load on the host."""
    if pgid is None:
        return 0.0
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # field 5, pgrp
            total += int(fields[11]) + int(fields[12])  # fields 14, 15: utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def prompt(i: int, length: int) -> list[int]:
    return [(7 * i + 13 * k) % 500 + 3 for k in range(length)]


def run(pin: str, hardened: bool, requests: int, profile: str, prompt_len: int, new_tokens: int,
        log_root: Path, extra_env: dict[str, str]) -> dict[str, Any]:
    env = {"SGLANG_HARDEN_TESTBED_CUDASIM_TOP": "1000", **({"SGLANG_HARDEN_ACTIVATE": "1"} if hardened else {}),
           **extra_env}
    log_dir = log_root / f"{pin}-{'hardened' if hardened else 'vanilla'}-{int(time.time())}"
    pair = PDPair(pin, prefill_max_total_tokens=1024, decode_max_total_tokens=1024, context_length=512,
                  profile=get_profile(profile), env=env, log_dir=log_dir, progress=True,
                  launcher_module=HARDENED_LAUNCHER if hardened else VANILLA_LAUNCHER)
    started = time.monotonic()
    with pair:
        ready_s = time.monotonic() - started
        ready_cpu = {role: round(group_cpu_s(s.pid), 1) for role, s in (("prefill", pair.prefill),
                                                                         ("decode", pair.decode))}
        warm = pair.generate(greedy_body(prompt(999, prompt_len), new_tokens, logprobs=False))
        before = {"prefill": sim_state(pair.prefill), "decode": sim_state(pair.decode)}
        cpu_before = {"prefill": group_cpu_s(pair.prefill.pid), "decode": group_cpu_s(pair.decode.pid)}
        latencies, outputs, statuses = [], [], []
        for i in range(requests):
            t0 = time.monotonic()
            res = pair.generate(greedy_body(prompt(i, prompt_len), new_tokens, logprobs=False))
            latencies.append(time.monotonic() - t0)
            outputs.append(res.decode.output_ids)
            statuses.append([res.prefill.status, res.decode.status])
        cpu_per_request = {"prefill": round((group_cpu_s(pair.prefill.pid) - cpu_before["prefill"]) / requests, 3),
                           "decode": round((group_cpu_s(pair.decode.pid) - cpu_before["decode"]) / requests, 3)}
        after = {"prefill": sim_state(pair.prefill), "decode": sim_state(pair.decode)}
        pools = pair.wait_quiesced()
    return {
        "pin": pin, "variant": "hardened" if hardened else "vanilla", "profile": profile, "env": extra_env,
        "ready_s": {"pair": round(ready_s, 1), "prefill": pair.prefill.ready_s, "decode": pair.decode.ready_s},
        "ready_cpu_s": ready_cpu, "cpu_s_per_request": cpu_per_request,
        "warmup_status": [warm.prefill.status, warm.decode.status],
        "latency_s": {"median": round(statistics.median(latencies), 3), "mean": round(statistics.mean(latencies), 3),
                      "all": [round(x, 3) for x in latencies]},
        "statuses": statuses, "outputs": outputs, "pools": pools,
        "simulator": bool(after["prefill"]),
        "per_request": {role: per_request(before[role], after[role], requests) for role in ("prefill", "decode")},
        "log_dir": str(log_dir),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pin", action="append", required=True)
    parser.add_argument("--variant", action="append", choices=["vanilla", "hardened"])
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--profile", default="paged16")
    parser.add_argument("--prompt-len", type=int, default=150)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--log-root", default="/tmp/sglang-harden-cudasim-probe")
    parser.add_argument("--env", action="append", default=[], metavar="K=V", help="extra env for both servers")
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args()
    report = []
    for pin in args.pin:
        for variant in args.variant or ["vanilla", "hardened"]:
            report.append(run(pin, variant == "hardened", args.requests, args.profile, args.prompt_len,
                              args.new_tokens, Path(args.log_root), dict(kv.split("=", 1) for kv in args.env)))
            print(json.dumps(report[-1]["per_request"], indent=1), file=sys.stderr)
    text = json.dumps(report, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
