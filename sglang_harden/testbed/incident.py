"""The PD incident, as a scenario: tenant B's oversized prompt reads tenant A's KV on a vulnerable pin.

Setup (see shared/notes/cpu-sglang.md): no radix cache, context 512; prefill ``--max-total-tokens 256`` so
its ``max_req_input_len`` is 250; decode ``--max-total-tokens 400 --num-reserved-decode-tokens 32`` so a
300-token prompt fits there. Tenant A sends 200 distinctive tokens; then tenant B sends 300 tokens, greedy.

On a vulnerable pin prefill rejects B's prompt but still "transfers" a 1-token stub; decode commits B with
300 context rows of which only row 0 was written, and greedy-decodes over whatever the previous owner left.

Oracles, both collected by :func:`run_incident`:
- black box: B's HTTP status and output; B's output as a function of A's content (the same A twice gives
  the same B, a different A a different B);
- white box: the decode-side KV tracer (test shim) counts, at B's first decode step, B's slots whose rows
  are byte-identical to what A left there at its release ("pages of A read by B").
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sglang_harden.testbed import jsonl
from sglang_harden.testbed.client import PairResult, greedy_body
from sglang_harden.testbed.pd_topology import PDPair
from sglang_harden.testbed.profiles import Profile
from sglang_harden.testbed.server import HARDENED_LAUNCHER, VANILLA_LAUNCHER

KVTRACE_ENV = "SGLANG_HARDEN_TESTBED_KVTRACE_DIR"
WAITING_TIMEOUT_ENV = "SGLANG_DISAGGREGATION_WAITING_TIMEOUT"
# The commit gate's page checks (page tags, canary, digest) judge a transfer at its first success poll, before
# coverage's check at the commit: a pair that proves coverage on a short send turns them off (plugin and series).
COVERAGE_ALONE = {"SGLANG_HARDEN_PAGE_TAGS": "off", "SGLANG_HARDEN_CANARY": "off", "SGLANG_HARDEN_CHECKSUM": "off"}
Progress = Callable[[str], None]


@dataclass(frozen=True)
class IncidentSetup:
    """Sizes of the scenario; defaults reproduce the incident measured on this machine kind."""

    context_length: int = 512
    prefill_max_total_tokens: int = 256
    decode_max_total_tokens: int = 400
    num_reserved_decode_tokens: int = 32
    a_len: int = 200
    b_len: int = 300
    new_tokens: int = 16
    # Decode's wait for a transfer that never comes (pins that reject at prefill): lowered from 300 s.
    waiting_timeout_s: int = 20
    # After the last round, how long each allocator may take to be back to full capacity.
    quiesce_timeout_s: float = 10.0
    # Front-door round: prefill gets a prompt longer than the context (its tokenizer refuses it), decode the
    # B-sized one it can hold; decode must hear of the refusal instead of waiting out its timeout.
    front_door_len: int = 600
    warmup_seed: int = 100
    # Tenant A's content per measured round (after one warm-up round); repeats give the repeatability oracle.
    a_seeds: tuple[int, ...] = (1, 2, 1, 2)


def tenant_a_prompt(seed: int, length: int) -> list[int]:
    """Distinctive content: ``length`` token ids drawn from a seeded generator (ids 3.., skipping specials)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(length)]


def tenant_b_prompt(length: int) -> list[int]:
    """B's oversized prompt: always the same tokens, so any change in B's output comes from elsewhere."""
    return [3 + (i * 37) % 500 for i in range(length)]


def read_kvtrace(folder: Path, live: bool = False) -> list[dict[str, Any]]:
    """The KV tracer's events (``live``: while the servers still write them; see :mod:`.jsonl`)."""
    return jsonl.read_folder(folder, "kvtrace-", live)


def first_decode_event(folder: Path, rid: str) -> dict[str, Any] | None:
    for event in read_kvtrace(folder):
        if event.get("event") == "first_decode" and event.get("rid") == rid:
            return event
    return None


@dataclass
class RoundResult:
    """One round: A then B, both as directly paired PD requests."""

    index: int
    a_seed: int
    a_rid: str
    b_rid: str
    a: PairResult
    b: PairResult
    b_rows: int | None = None
    a_rows_read_by_b: int = 0
    foreign_rows: dict[str, int] = field(default_factory=dict)
    # rows of other requests' KV that A's first decode step read (None: the tracer saw no decode step of A)
    a_foreign_rows: int | None = None

    def b_fingerprint(self) -> tuple[Any, ...] | None:
        d = self.b.decode
        return None if not d.ok else (tuple(d.output_ids or ()), tuple(d.logprobs or ()))

    def to_dict(self) -> dict[str, Any]:
        return {
            "round": self.index,
            "a_seed": self.a_seed,
            "a_rid": self.a_rid,
            "b_rid": self.b_rid,
            "a_prefill_status": self.a.prefill.status,
            "a_decode_status": self.a.decode.status,
            "b_prefill": self.b.prefill.summary(),
            "b_decode": self.b.decode.summary(),
            "b_rows": self.b_rows,
            "a_pages_read_by_b": self.a_rows_read_by_b,
            "foreign_rows": self.foreign_rows,
            "a_foreign_rows": self.a_foreign_rows,
        }


def start_incident_pair(
    pin: str,
    *,
    hardened: bool = False,
    setup: IncidentSetup = IncidentSetup(),
    log_dir: Path,
    transfer_backend: str = "mooncake",
    router: bool = False,
    extra_env: Mapping[str, str] | None = None,
    progress: bool = False,
    harden_env: Mapping[str, str] | None = None,
    profile: Profile | None = None,
    flags: Sequence[str] = (),
    model_path: Path | None = None,
) -> PDPair:
    """Start (and return, started) the asymmetric PD pair of the incident, with the KV tracer on decode;
    ``flags``: more server arguments for both servers; ``model_path``: another model than the tiny Llama."""
    env = {WAITING_TIMEOUT_ENV: str(setup.waiting_timeout_s), **(extra_env or {})}
    if hardened:
        env.update({"SGLANG_HARDEN_ACTIVATE": "1", **(harden_env or {})})
    pair = PDPair(
        pin,
        prefill_max_total_tokens=setup.prefill_max_total_tokens,
        decode_max_total_tokens=setup.decode_max_total_tokens,
        context_length=setup.context_length,
        num_reserved_decode_tokens=setup.num_reserved_decode_tokens,
        transfer_backend=transfer_backend,
        profile=profile,
        env=env,
        decode_env={KVTRACE_ENV: str(Path(log_dir) / "kvtrace")},
        launcher_module=HARDENED_LAUNCHER if hardened else VANILLA_LAUNCHER,
        router=router,
        prefill_flags=list(flags),
        decode_flags=list(flags),
        log_dir=log_dir,
        progress=progress,
        model_path=model_path,
    )
    return pair.start()


def run_round(pair: PDPair, index: int, a_seed: int, setup: IncidentSetup, tag: str = "") -> RoundResult:
    """Tenant A (distinctive content), then tenant B (oversized, greedy); collect both oracles."""
    a_rid, b_rid = f"{tag}A{index}-s{a_seed}", f"{tag}B{index}"
    # top logprobs from decode only: 0.5.10.post1's prefill tokenizer dies on them in PD mode (measured: "Boolean value
    # of Tensor with more than one value is ambiguous" in detokenize_top_logprobs_tokens, the prefill server gone)
    a_body = greedy_body(tenant_a_prompt(a_seed, setup.a_len), setup.new_tokens, rid=a_rid)
    a = pair.generate({**a_body, "top_logprobs_num": 3}, prefill_body=a_body, timeout=setup.waiting_timeout_s + 120)
    b = pair.generate(
        greedy_body(tenant_b_prompt(setup.b_len), setup.new_tokens, rid=b_rid), timeout=setup.waiting_timeout_s + 120
    )
    result = RoundResult(index=index, a_seed=a_seed, a_rid=a_rid, b_rid=b_rid, a=a, b=b)
    a_event = first_decode_event(pair.log_dir / "kvtrace", a_rid)
    if a_event is not None:
        result.a_foreign_rows = sum(int(v) for v in a_event.get("foreign_rows", {}).values())
    event = first_decode_event(pair.log_dir / "kvtrace", b_rid)
    if event is not None:
        result.b_rows = int(event["rows"])
        result.foreign_rows = {k: int(v) for k, v in event.get("foreign_rows", {}).items()}
        result.a_rows_read_by_b = result.foreign_rows.get(a_rid, 0)
    return result


def front_door_round(pair: PDPair, setup: IncidentSetup, tag: str = "") -> dict[str, Any]:
    """A request prefill's front door (tokenizer validation) refuses while decode holds its reservation."""
    rid = f"{tag}F"
    decode_body = greedy_body(tenant_b_prompt(setup.b_len), setup.new_tokens, rid=rid)
    prefill_body = greedy_body(tenant_b_prompt(setup.front_door_len), setup.new_tokens, rid=rid)
    result = pair.generate(decode_body, prefill_body=prefill_body, timeout=setup.waiting_timeout_s + 120)
    return {
        "rid": rid,
        "room": result.room,
        "prefill": result.prefill.summary(),
        "prefill_error": None if result.prefill.ok else result.prefill.error_message(),
        "decode_status": result.decode.status,
        "decode_error": None if result.decode.ok else result.decode.error_message(),
        "decode_elapsed_s": round(result.decode.elapsed_s, 2),
        "decode_generated": first_decode_event(pair.log_dir / "kvtrace", rid) is not None,
    }


def black_box(rounds: Sequence[RoundResult]) -> dict[str, Any]:
    """B's output as a function of A's content, over the measured rounds (warm-up excluded by the caller)."""
    by_seed: dict[int, list[tuple[Any, ...]]] = {}
    for r in rounds:
        fp = r.b_fingerprint()
        if fp is not None:
            by_seed.setdefault(r.a_seed, []).append(fp)
    distinct_per_seed = {seed: len(set(fps)) for seed, fps in by_seed.items()}
    distinct_outputs = {fp for fps in by_seed.values() for fp in fps}
    per_seed_first = {fps[0] for fps in by_seed.values()}
    return {
        "b_completed_rounds": sum(len(v) for v in by_seed.values()),
        "repeatable": bool(by_seed) and all(n == 1 for n in distinct_per_seed.values()),
        "depends_on_a": len(per_seed_first) > 1,
        "distinct_b_outputs": len(distinct_outputs),
        "seeds": sorted(by_seed),
    }


def verdict(rounds: Sequence[RoundResult], bb: dict[str, Any], setup: IncidentSetup) -> str:
    if not rounds:
        return "no-data"
    b_ok = any(r.b.decode.ok for r in rounds)
    pages = max(r.a_rows_read_by_b for r in rounds)
    if b_ok and (pages > 0 or bb["depends_on_a"]):
        return "LEAK"
    last = rounds[-1].b
    if not last.decode.ok and last.prefill.status >= 400:
        held = last.decode.elapsed_s >= 0.8 * setup.waiting_timeout_s
        return "rejected; decode held its reservation until timeout" if held else "rejected"
    if b_ok:
        return "served (no leak observed)"
    return "failed"


def _short(ids: list[int] | None, n: int = 6) -> str:
    if not ids:
        return "-"
    return " ".join(map(str, ids[:n])) + (" ..." if len(ids) > n else "")


def run_incident(
    pin: str,
    hardened: bool = False,
    *,
    setup: IncidentSetup = IncidentSetup(),
    log_dir: Path | None = None,
    transfer_backend: str = "mooncake",
    extra_env: Mapping[str, str] | None = None,
    harden_env: Mapping[str, str] | None = None,
    progress: Progress | None = None,
    profile: Profile | None = None,
    flags: Sequence[str] = (),
    model_path: Path | None = None,
    more_requests: Callable[[PDPair], Any] | None = None,
) -> dict[str, Any]:
    """Start a fresh incident pair for ``pin`` (vanilla, or hardened through ``sglang_harden.launch_server``
    with ``SGLANG_HARDEN_ACTIVATE=1``), run a warm-up round and the measured rounds, stop the pair, and
    return a JSON-able summary: B's statuses and output, pages of A read by B, both oracles, a verdict.
    ``more_requests``: what else the test sends the pair once both pools were back at quiesce (its answer in the
    summary's ``more_requests``; not JSON-able unless the callable's answer is)."""
    import tempfile

    say = progress or (lambda _msg: None)
    variant = "hardened" if hardened else "vanilla"
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix=f"sglang-harden-incident-{pin}-{variant}-"))
    t0 = time.monotonic()
    say(f"{pin} {variant}: starting prefill + decode (logs in {log_dir})")
    pair = start_incident_pair(
        pin,
        hardened=hardened,
        setup=setup,
        log_dir=log_dir,
        transfer_backend=transfer_backend,
        extra_env=extra_env,
        harden_env=harden_env,
        progress=progress is not None,
        profile=profile,
        flags=flags,
        model_path=model_path,
    )
    try:
        startup_s = time.monotonic() - t0
        say(f"{pin} {variant}: servers ready in {startup_s:.1f} s; warm-up round")
        warm = run_round(pair, 0, setup.warmup_seed, setup)
        rounds: list[RoundResult] = []
        if warm.b.decode.ok or warm.b.prefill.ok:
            for i, seed in enumerate(setup.a_seeds, start=1):
                say(f"{pin} {variant}: round {i}/{len(setup.a_seeds)} (tenant A seed {seed})")
                rounds.append(run_round(pair, i, seed, setup))
                if not rounds[-1].b.decode.ok and rounds[-1].b.prefill.status >= 400:
                    break
        say(f"{pin} {variant}: front-door round (prefill's tokenizer refuses, decode holds a reservation)")
        front_door = front_door_round(pair, setup)
        say(f"{pin} {variant}: waiting for both allocators to be back to full capacity")
        quiesce = pair.wait_quiesced(timeout=setup.quiesce_timeout_s)
        more = more_requests(pair) if more_requests is not None else None
    finally:
        t_stop = time.monotonic()
        pair.stop()
        stop_s = time.monotonic() - t_stop
    summary = summarize(
        pin, variant, warm, rounds, setup, startup_s, stop_s, time.monotonic() - t0, log_dir, transfer_backend
    )
    summary["front_door"] = front_door
    if more_requests is not None:
        summary["more_requests"] = more
    summary["pools_at_quiesce"] = quiesce
    summary["pools_full_at_quiesce"] = all(p.get("full") for p in quiesce.values())
    return summary


def summarize(
    pin: str,
    variant: str,
    warm: RoundResult,
    rounds: list[RoundResult],
    setup: IncidentSetup,
    startup_s: float,
    stop_s: float,
    total_s: float,
    log_dir: Path,
    transfer_backend: str,
) -> dict[str, Any]:
    measured = rounds or [warm]
    bb = black_box(rounds)
    first_b = measured[0].b
    return {
        "pin": pin,
        "variant": variant,
        "transfer_backend": transfer_backend,
        "b_status": first_b.decode.status,
        "b_prefill_status": first_b.prefill.status,
        "b_prefill_error": None if first_b.prefill.ok else first_b.prefill.error_message(),
        "b_decode_error": None if first_b.decode.ok else first_b.decode.error_message(),
        "b_decode_elapsed_s": round(first_b.decode.elapsed_s, 2),
        "b_prompt_tokens": first_b.decode.meta.get("prompt_tokens"),
        "b_output_ids": first_b.decode.output_ids,
        "b_output_short": _short(first_b.decode.output_ids),
        "pages_of_a_read_by_b": max(r.a_rows_read_by_b for r in measured),
        "b_rows": measured[0].b_rows,
        "black_box": bb,
        "verdict": verdict(measured, bb, setup),
        "timings_s": {"startup": round(startup_s, 1), "stop": round(stop_s, 1), "total": round(total_s, 1)},
        "setup": asdict(setup),
        "warmup": warm.to_dict(),
        "rounds": [r.to_dict() for r in rounds],
        "log_dir": str(log_dir),
    }


TOO_LONG = "exceeds the maximum allowed length"


def assert_b_refused_at_both_doors(rnd: RoundResult, bound_s: float) -> None:
    """Tenant B refused by prefill with its original "too long" 400, and decode answering the same within
    ``bound_s`` (told, not timed out), with no completion and no row of A's KV read."""
    b = rnd.b
    assert b.prefill.status == 400, b.prefill.summary()
    assert TOO_LONG in b.prefill.error_message()
    assert b.decode.status == 400, b.decode.summary()
    assert TOO_LONG in b.decode.error_message(), b.decode.error_message()
    assert b.decode.elapsed_s < bound_s, f"decode answered B after {b.decode.elapsed_s:.1f}s"
    assert not b.decode.output_ids
    assert rnd.a_rows_read_by_b == 0


def kvfault_events(folder: Path, event: str) -> list[dict[str, Any]]:
    """The test-only kvfault shim's ``event`` lines in a pair's trace folder."""
    return [line for line in jsonl.read_folder(folder, "kvfault-") if line.get("event") == event]


def table_fault_round(pair: PDPair, room: int, seed: int = 21) -> dict[str, Any]:
    """One request in ``room``, whose page table the kvfault shim (``table:<room>``) points at a free page before
    decode commits it: its answer, the fault lines and the KV tracer's first decode step of it (the
    ``assert_table_fault_read_by_vanilla`` fields). Last on a pair: the pool is inconsistent afterwards."""
    rid = f"table-fault-{room}"
    table = pair.generate(greedy_body(tenant_a_prompt(seed, 120), 8, rid=rid), room=room, timeout=240)
    trace = pair.log_dir / "kvtrace"
    return {"table": table, "table_fault": kvfault_events(trace, "table_fault"),
            "table_first_decode": first_decode_event(trace, rid)}


def assert_table_fault_read_by_vanilla(vanilla: dict[str, Any], guarded: dict[str, Any]) -> None:
    """The kvfault ``table`` fault was applied once on each pair (so a refusal is not a fault that never happened),
    and vanilla decoded over the page it points at: status 200, the KV tracer saw that page and rows another request
    left there. ``vanilla``/``guarded``: a run's ``table`` result, ``table_fault`` lines and ``table_first_decode``."""
    for run in (vanilla, guarded):
        assert len(run["table_fault"]) == 1, run["table_fault"]
        fault = run["table_fault"][0]
        assert fault["page_now"] != fault["page_was"], fault
    read = vanilla["table_first_decode"]
    assert vanilla["table"].decode.status == 200 and read is not None, vanilla["table"].decode.summary()
    assert vanilla["table_fault"][0]["page_now"] in read["pages"], (read, vanilla["table_fault"])
    assert read["foreign_total"] > 0, read
