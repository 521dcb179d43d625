"""The pieces of the guard cost benchmark (``scripts/bench_guards.py``): its variants, its workload and one
measured round on a PD pair.

Variants: ``vanilla`` (``sglang.launch_server``, plugin off), ``all`` (``sglang_harden.launch_server``, every
guard and the capacity gate at their defaults), ``<guard>`` for each name in ``config.GUARDS`` (that guard
enforced, with the guards it needs (``NEEDS``: ``zmq_auth`` takes its keys from ``bootstrap_auth``); every other
guard and the capacity gate off) and, on request only, ``capacity`` (the capacity gate
alone), ``none`` (the launcher with every guard and the gate off: what the plugin costs by being there) and
``aa`` (a second vanilla pair: the A/A control, whose ratio shows what two pairs differ by with no guard at all).
Every variant gets the same server flags; only the launcher and the ``SGLANG_HARDEN_*`` environment differ. The
testbed gives every server of a pin with control-plane authentication its secret file
(``SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE``), so ``bootstrap_auth`` is armed wherever it is on.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang_harden.config import ACTIVATE_ENV, ENV_PREFIX, GUARDS
from sglang_harden.testbed.client import greedy_body
from sglang_harden.testbed.pd_topology import PDPair
from sglang_harden.testbed.server import HARDENED_LAUNCHER, VANILLA_LAUNCHER

BASELINE = "vanilla"
EVERY_GUARD = "all"
CONTROL = "aa"
OPTIONAL_VARIANTS = ("capacity", "none", CONTROL)
DEFAULT_VARIANTS: tuple[str, ...] = (BASELINE, EVERY_GUARD, *GUARDS)
KNOWN_VARIANTS: tuple[str, ...] = (*DEFAULT_VARIANTS, *OPTIONAL_VARIANTS)
CAPACITY_ENV = ENV_PREFIX + "CAPACITY"
# a guard measured with the guards it cannot run without: the ZMQ side channels' keys are the control plane's
NEEDS: dict[str, tuple[str, ...]] = {"zmq_auth": ("bootstrap_auth",)}


def guard_env(guard: str) -> str:
    """``lifecycle`` -> ``SGLANG_HARDEN_LIFECYCLE``."""
    return ENV_PREFIX + guard.upper()


@dataclass(frozen=True)
class Variant:
    name: str
    launcher: str
    env: dict[str, str]
    # the guards whose start-up lines the variant's schedulers must show, together (None: not checked)
    expected_guards: frozenset[str] | None


def variant(name: str) -> Variant:
    """The launcher and ``SGLANG_HARDEN_*`` environment of one variant."""
    if name in (BASELINE, CONTROL):
        return Variant(name, VANILLA_LAUNCHER, {ACTIVATE_ENV: "0"}, frozenset())
    if name == EVERY_GUARD:
        return Variant(name, HARDENED_LAUNCHER, {ACTIVATE_ENV: "1"}, None)
    if name not in KNOWN_VARIANTS:
        raise ValueError(f"unknown variant {name!r}; known: {', '.join(KNOWN_VARIANTS)}")
    env = {ACTIVATE_ENV: "1", CAPACITY_ENV: "enforce" if name == "capacity" else "off"}
    alone = frozenset({name, *NEEDS.get(name, ())}) & frozenset(GUARDS)
    for guard in GUARDS:
        env[guard_env(guard)] = "enforce" if guard in alone else "off"
    return Variant(name, HARDENED_LAUNCHER, env, alone)


def parse_variants(text: str | None) -> list[str]:
    """``--variants``: a comma-separated subset (order kept, duplicates dropped); ``vanilla`` is always measured
    (it is the baseline every round compares against) and need not be named. None or empty: the default set."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()] or list(DEFAULT_VARIANTS)
    for name in names:
        variant(name)  # raises on an unknown name
    ordered = list(dict.fromkeys(n for n in names if n != BASELINE))
    if not ordered:
        raise ValueError("--variants names no variant to compare with vanilla")
    return ordered


@dataclass(frozen=True)
class Workload:
    """A round's benign requests: ``requests`` greedy requests of ``new_tokens`` tokens each, prompts of
    ``min_prompt``..``max_prompt`` token ids drawn from a generator seeded by the round, sent by ``clients``
    concurrent clients (each takes the next request when its last one is answered)."""

    requests: int = 24
    clients: int = 4
    new_tokens: int = 16
    min_prompt: int = 100
    max_prompt: int = 300
    timeout_s: float = 120.0

    def prompts(self, seed: int) -> list[list[int]]:
        """The round's prompts: distinct, the same for every pair given the same ``seed``."""
        rng = random.Random(seed)
        return [[rng.randrange(3, 512) for _ in range(rng.randint(self.min_prompt, self.max_prompt))]
                for _ in range(self.requests)]


@dataclass
class PairShare:
    """One pair's share of a round: what it served, the time it was measured (the sum of its slices' wall
    times) and the CPU seconds of itself, of the idle pair and of the whole machine meanwhile (the idle pair
    should stay near zero: it sleeps; the machine minus both pairs is load from elsewhere)."""

    pair: str
    wall_s: float = 0.0
    requests: int = 0
    output_tokens: int = 0
    latencies_s: list[float] = field(default_factory=list)
    measured_cpu_s: float = 0.0
    idle_cpu_s: float = 0.0
    machine_cpu_s: float = 0.0

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def req_per_s(self) -> float:
        return self.requests / self.wall_s

    @property
    def p50_s(self) -> float:
        return statistics.median(self.latencies_s)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pair": self.pair, "requests": self.requests, "output_tokens": self.output_tokens}
        for key in ("wall_s", "tok_per_s", "req_per_s", "p50_s", "measured_cpu_s", "idle_cpu_s", "machine_cpu_s"):
            out[key] = round(getattr(self, key), 5)
        out["latencies_s"] = [round(x, 4) for x in self.latencies_s]
        return out


def _one(pair: PDPair, prompt: list[int], workload: Workload) -> tuple[float, int]:
    body = greedy_body(prompt, workload.new_tokens, rid=None, logprobs=False)
    start = time.monotonic()
    result = pair.generate(body, timeout=workload.timeout_s)
    elapsed = time.monotonic() - start
    if not (result.prefill.ok and result.decode.ok):
        raise RuntimeError(f"request failed: prefill {result.prefill.summary()}, decode {result.decode.summary()}")
    return elapsed, int(result.decode.meta.get("completion_tokens") or workload.new_tokens)


def slice_order(first: str, second: str, slices: int) -> list[tuple[str, str]]:
    """Which pair is measured (and which idles) in each step of a round: slice by slice, both pairs in turn,
    ``first`` going first in even slices and second in odd ones."""
    steps: list[tuple[str, str]] = []
    for s in range(slices):
        a, b = (first, second) if s % 2 == 0 else (second, first)
        steps += [(a, b), (b, a)]
    return steps


def run_round(pairs: dict[str, PDPair], first: str, prompts: Sequence[list[int]], workload: Workload,
              settle_s: float) -> dict[str, PairShare]:
    """One round: ``prompts`` through both pairs, in slices of ``workload.clients`` requests sent concurrently;
    each slice goes to one pair, then to the other (the order alternating by slice), so that drift of the machine
    falls on both alike. Only the measured pair gets requests; each step waits ``settle_s`` first."""
    first_name, second_name = first, next(name for name in pairs if name != first)
    shares = {name: PairShare(name) for name in pairs}
    batches = [list(prompts[i:i + workload.clients]) for i in range(0, len(prompts), workload.clients)]
    steps = slice_order(first_name, second_name, len(batches))
    with ThreadPoolExecutor(max_workers=workload.clients) as pool:
        for step, (name, idle_name) in enumerate(steps):
            pair, idle = pairs[name], pairs[idle_name]
            time.sleep(settle_s)
            groups, idle_groups = pair_groups(pair), pair_groups(idle)
            cpu0 = (group_cpu_seconds(groups), group_cpu_seconds(idle_groups), machine_cpu_seconds())
            start = time.monotonic()
            answers = list(pool.map(lambda prompt, p=pair: _one(p, prompt, workload), batches[step // 2]))
            wall = time.monotonic() - start
            cpu1 = (group_cpu_seconds(groups), group_cpu_seconds(idle_groups), machine_cpu_seconds())
            share = shares[name]
            share.wall_s += wall
            share.requests += len(answers)
            share.output_tokens += sum(count for _, count in answers)
            share.latencies_s += [elapsed for elapsed, _ in answers]
            share.measured_cpu_s += cpu1[0] - cpu0[0]
            share.idle_cpu_s += cpu1[1] - cpu0[1]
            share.machine_cpu_s += cpu1[2] - cpu0[2]
    return shares


def pair_groups(pair: PDPair) -> list[int]:
    """The process groups of a started pair (each server's pid is its group id)."""
    return [part.pid for part in pair.parts() if part.pid is not None]


def group_cpu_seconds(pgids: Iterable[int]) -> float:
    """User + system CPU seconds so far of the live processes in these process groups (from /proc)."""
    wanted = set(pgids)
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) in wanted:  # fields: state, ppid, pgrp, ..., utime (11), stime (12)
            total += int(fields[11]) + int(fields[12])
    return total / ticks


def machine_cpu_seconds() -> float:
    """Busy CPU seconds of the whole machine so far, all cores (``/proc/stat``: everything but idle and iowait)."""
    with open("/proc/stat") as f:
        parts = f.readline().split()
    values = [int(x) for x in parts[1:9]]  # user nice system idle iowait irq softirq steal
    busy = sum(values) - values[3] - values[4]
    return busy / os.sysconf("SC_CLK_TCK")


def armed_guards(pair: PDPair) -> dict[str, list[str]]:
    """Per role, the guards the pair's schedulers logged as armed (their union over the role's schedulers)."""
    out: dict[str, list[str]] = {}
    for server in (pair.prefill, pair.decode):
        found: set[str] = set()
        for line in server.armed_schedulers():
            found.update(line.guards)
        out[server.role] = sorted(found)
    return out


def check_armed(spec: Variant, armed: dict[str, list[str]]) -> None:
    """Raise when the pair's schedulers armed other guards than the variant says (vanilla: none at all)."""
    if spec.expected_guards is None:
        return
    union = {g for guards in armed.values() for g in guards}
    if union != set(spec.expected_guards):
        raise RuntimeError(f"variant {spec.name}: expected guards {sorted(spec.expected_guards)} armed, "
                           f"the schedulers logged {armed}")
