"""Soak: drive a real PD topology with mixed, hostile traffic and judge it with oracles the guards do not own.

One run = one topology (started here, or a running one described by ``sglang-harden testbed start``'s state file)
and one load for ``duration_s``: ``concurrency`` client threads, each sending one request after another for one of
``tenants`` tenants. A request is one of

- ``normal``: the tenant's shared prefix (so prefill's radix cache hits) plus a random suffix; must answer 200
  with every token it asked for;
- ``oversized``: longer than prefill's KV pool but within the context (the incident); must be refused (4xx/503)
  within ``refused_bound_s``; served with 200 is the incident;
- ``disconnect``: a normal request whose client hangs up after a random delay (during prefill, transfer or
  decode, depending on where it is by then);
- caught in an ``/abort_request`` burst: every ``abort_burst_every_s`` up to ``abort_burst_size`` in-flight normal
  requests are aborted on both servers;
- ``late_write`` (``late_writes`` of them, evenly spread; paired directly or through the router, the shim finds
  the room by the request's rid): prefill's engine call for its KV gives up after 1 s and reports failure while
  the bytes land ``late_write_delay_s`` after the send started (test-only ``latewrite`` shim): a late RDMA write
  into pages decode may already have handed to someone else. Its own answer is not judged (``faulted``).

Oracles (none of them reads sglang-harden's ledger or page tags):

- foreign reads, from the decode KV tracer shim (``sglang_harden_kvtrace``): context rows a request's first decode
  step read that hold what another request with a different token prefix left there, plus context rows changed
  under a request while it decoded (a late write);
- double frees: page ids present more than once in an allocator's free lists (testbed pool reporter);
- pages leaked at quiesce: each allocator not back to full capacity within ``quiesce_timeout_s`` of the end;
- guard refusals and quarantine: the hardened servers' own counters, reported (not used as oracles).

``compare`` runs the same load (same seed) on a vanilla and then a hardened topology and reports
hardened/vanilla ratios of throughput and latency.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sglang_harden.testbed.incident import KVTRACE_ENV, WAITING_TIMEOUT_ENV, read_kvtrace
from sglang_harden.testbed.pd_topology import PDFleet, PDPair
from sglang_harden.testbed.profiles import get_profile
from sglang_harden.testbed.server import HARDENED_LAUNCHER, VANILLA_LAUNCHER
from sglang_harden.testbed.soak_judging import (
    SoakReport,
    decision_delta,
    foreign_reads,
    forged_summary,
    notify_summary,
    quiesce,
    summarize,
)
from sglang_harden.testbed.soak_load import LoadRun
from sglang_harden.testbed.soak_report import write_outcomes
from sglang_harden.testbed.soak_requests import Target, pool_of
from sglang_harden.testbed.soak_spec import SoakLoad, SoakTopology


def start_topology(topo: SoakTopology, load: SoakLoad, hardened: bool, log_dir: Path, progress: bool
                   ) -> PDPair | PDFleet:
    env = {WAITING_TIMEOUT_ENV: str(topo.waiting_timeout_s)}
    if hardened:  # the pools are deliberately smaller than the context (the incident): the gate only logs
        env.update({"SGLANG_HARDEN_ACTIVATE": "1", "SGLANG_HARDEN_CAPACITY": "log",
                    # CPU testbed only: on the 2-core CI host under this load a prefill bootstrap server once took
                    # over the default 5 s to answer a digest query, and decode refused a clean request (fail
                    # closed; CI 2026-12-04, 0.5.23/NIXL). Production keeps the default.
                    "SGLANG_HARDEN_CHECKSUM_WAIT_MS": "20000"})
    if load.late_writes:
        env.update({**load.late_write_trigger_env(log_dir / "kvtrace"), KVTRACE_ENV: str(log_dir / "kvtrace")})
        if hardened:  # the sender's bound on a timed-out write's lifetime must cover the injected delay
            env["SGLANG_HARDEN_TRANSFER_WRITE_LIFETIME_S"] = str(int(load.late_write_delay_s + 3))
    common: dict[str, Any] = dict(
        prefill_max_total_tokens=topo.prefill_max_total_tokens,
        decode_max_total_tokens=topo.decode_max_total_tokens,
        context_length=topo.context_length,
        transfer_backend=topo.backend,
        profile=get_profile(topo.profile),
        env=env,
        decode_env={KVTRACE_ENV: str(log_dir / "kvtrace")},
        launcher_module=HARDENED_LAUNCHER if hardened else VANILLA_LAUNCHER,
        log_dir=log_dir,
        progress=progress,
    )
    if topo.prefills > 1 or topo.decodes > 1:
        return PDFleet(topo.pin, prefills=topo.prefills, decodes=topo.decodes, **common).start()
    return PDPair(topo.pin, router=topo.router, **common).start()


def drive(target: Target, load: SoakLoad, topo: SoakTopology, variant: str, kvtrace_dir: Path | None,
          progress: Callable[[str], None] | None = None, log_dir: str = "") -> SoakReport:
    """Run the load against ``target`` and judge it."""
    before = {name: pool_of(url).get("decisions", {}) for name, url in target.nodes.items()}
    run = LoadRun(target, load, topo, progress, kvtrace_dir)
    wall = run.run()
    settled = quiesce(target, load.quiesce_timeout_s)
    after = {name: pool_of(url).get("decisions", {}) for name, url in target.nodes.items()}
    refusals = {role: {k: v for k, v in decision_delta(before[role], after[role]).items() if not k.endswith(":allow")}
                for role in before}
    first_decode = next(name for name in settled if name.startswith("decode"))
    decode_total = int((settled[first_decode].get("pool") or {}).get("total") or topo.decode_max_total_tokens)
    summary = summarize(run.outcomes, run.samples, wall, load, decode_total, get_profile(topo.profile).page_size)
    trace = foreign_reads(read_kvtrace(kvtrace_dir)) if kvtrace_dir is not None else None
    if log_dir:
        write_outcomes(Path(log_dir) / "outcomes.jsonl", run.outcomes)
    return SoakReport(variant, asdict(topo), asdict(load), round(wall, 1), summary, trace, settled, refusals, log_dir,
                      notify_summary(Path(log_dir)) if log_dir else {},
                      forged_summary(run.forged) if load.forged_control_every_s > 0 else {},
                      {str(room): rid for room, rid in run.lander.fired.items()} if run.lander else {})


def run_variant(topo: SoakTopology, load: SoakLoad, hardened: bool, log_root: Path,
                progress: Callable[[str], None] | None = None) -> SoakReport:
    variant = "hardened" if hardened else "vanilla"
    log_dir = log_root / f"{topo.pin}-{topo.backend}-{variant}"
    log_dir.mkdir(parents=True, exist_ok=True)
    started = start_topology(topo, load, hardened, log_dir, progress is not None)
    target = Target.of_fleet(started) if isinstance(started, PDFleet) else Target.of_pair(started)
    try:
        return drive(target, load, topo, variant, log_dir / "kvtrace", progress, str(log_dir))
    finally:
        started.stop()
