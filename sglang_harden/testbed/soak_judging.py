"""Judging a soak run: the oracles (foreign reads, leaks and double frees at quiesce), the run's summary and
its ``SoakReport`` with the violations a hardened run must never show."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sglang_harden.testbed.decisions import notify_latencies
from sglang_harden.testbed.soak_requests import Target, pool_of
from sglang_harden.testbed.soak_spec import Outcome, SoakLoad

TRACED_SHARE = 0.95  # of the requests served in full, the share the KV tracer must have seen decode


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    pos = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return round(ordered[pos], 3)


def foreign_reads(trace: list[dict[str, Any]]) -> dict[str, Any]:
    """Foreign rows read at first decode (left by a request with another prefix, or written after the commit)
    plus context rows changed while decoding, per the KV tracer."""
    first = [e for e in trace if e.get("event") == "first_decode"]
    released = [e for e in trace if e.get("event") == "release"]
    at_first = {e["rid"]: int(e.get("foreign_total") or 0) + int(e.get("rows_changed_since_commit") or 0)
                for e in first if int(e.get("foreign_total") or 0) + int(e.get("rows_changed_since_commit") or 0)}
    changed = {e["rid"]: int(e["context_rows_changed"]) for e in released if e.get("context_rows_changed")}
    return {
        "requests": len(set(at_first) | set(changed)),
        "rows": sum(at_first.values()) + sum(changed.values()),
        # foreign rows the tracer sees only since issue 40: left by a request that never finished (aborted,
        # disconnected, refused after allocation), or overwritten in part
        "rows_of_unfinished_owners": sum(int(e.get("foreign_from_unfinished") or 0) for e in first),
        "partial_rows": sum(int(e.get("partial_rows") or 0) for e in first),
        "examples": sorted(set(at_first) | set(changed))[:5],
        "traced_first_decodes": len(first),
        "tracer_errors": sum(1 for e in trace if e.get("event") == "error"),
    }


def decision_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)}
    return {k: v for k, v in sorted(delta.items()) if v}


def quiesce(target: Target, timeout: float) -> dict[str, dict[str, Any]]:
    """Poll both servers until their allocators are full again (or ``timeout``); leaked tokens and double frees."""
    deadline = time.monotonic() + timeout
    while True:
        now = {name: pool_of(url) for name, url in target.nodes.items()}
        leaks = {role: _leaked(numbers.get("pool") or {}) for role, numbers in now.items()}
        if all(v == 0 for v in leaks.values()) or time.monotonic() > deadline:
            return {role: {"leaked_tokens": leaks[role],
                           "double_frees": int((now[role].get("pool") or {}).get("duplicate_free_pages") or 0),
                           "quarantined_pages": int((now[role].get("lifecycle") or {}).get("quarantined_pages") or 0),
                           "pool": now[role].get("pool")}
                    for role in now}
        time.sleep(1.0)


def _leaked(pool: dict[str, Any]) -> int | None:
    if "total" not in pool:
        return None
    return max(0, int(pool["total"]) - int(pool["available"]) - int(pool["evictable"]))


def summarize(outcomes: list[Outcome], samples: list[dict[str, Any]], wall_s: float, load: SoakLoad,
              decode_pool_tokens: int, page_size: int) -> dict[str, Any]:
    verdicts = Counter(o.verdict for o in outcomes)
    ok = [o for o in outcomes if o.verdict == "ok"]
    refused = [o for o in outcomes if o.verdict == "refused"]
    quarantine = [max((int((numbers.get("lifecycle") or {}).get("quarantined_pages") or 0)
                       for name, numbers in sample.items() if name.startswith("decode")), default=0)
                  for sample in samples]
    decode_pages = max(1, decode_pool_tokens // max(1, page_size))
    return {
        "requests": len(outcomes),
        "by_outcome": dict(sorted(verdicts.items())),
        "by_kind": dict(sorted(Counter(o.kind for o in outcomes).items())),
        "refused_max_s": max((o.latency_s for o in refused), default=None),
        "refused_over_bound": sum(1 for o in refused if o.latency_s > load.refused_bound_s),
        "failed_examples": [asdict(o) for o in outcomes
                            if o.verdict in ("failed", "oversized_unanswered", "oversized_failed")][:5],
        "throughput_tokens_per_s": round(sum(o.tokens for o in ok) / wall_s, 2) if wall_s else None,
        "throughput_requests_per_s": round(len(ok) / wall_s, 3) if wall_s else None,
        "latency_p50_s": percentile([o.latency_s for o in ok], 50),
        "latency_p99_s": percentile([o.latency_s for o in ok], 99),
        "ttft_p50_s": percentile([o.ttft_s for o in ok if o.ttft_s is not None], 50),
        "ttft_p99_s": percentile([o.ttft_s for o in ok if o.ttft_s is not None], 99),
        "quarantine_max_pages": max(quarantine, default=0),
        "quarantine_max_share": round(max(quarantine, default=0) / decode_pages, 4),
        "quarantine_bound_pages": load.quarantine_bound_pages(decode_pages, page_size),
    }


def forged_summary(counts: Counter[str]) -> dict[str, Any]:
    """Forged control requests sent, refused with 401, and answered 2xx (accepted: a hole when hardened)."""
    statuses = Counter()
    for key, n in counts.items():
        statuses[int(key.rsplit(" ", 1)[1])] += n
    return {"sent": sum(counts.values()), "refused_401": statuses.get(401, 0),
            "accepted": sum(n for status, n in statuses.items() if 200 <= status < 300),
            "by_route": dict(sorted(counts.items()))}


def notify_summary(log_dir: Path) -> dict[str, Any]:
    """How fast decode heard of prefill's refusals and aborts in this run (from the servers' logs)."""
    prefill = [p.read_text(errors="replace") for p in sorted(log_dir.glob("prefill*.log"))]
    decode = [p.read_text(errors="replace") for p in sorted(log_dir.glob("decode*.log"))]
    gaps = list(notify_latencies(prefill, decode).values())
    return {"rooms": len(gaps), "p50_s": percentile(gaps, 50), "max_s": max(gaps, default=None)}


@dataclass
class SoakReport:
    variant: str
    topology: dict[str, Any]
    load: dict[str, Any]
    wall_s: float
    summary: dict[str, Any]
    foreign_reads: dict[str, Any] | None
    quiesce: dict[str, Any]
    refusals_by_guard: dict[str, dict[str, int]] = field(default_factory=dict)
    log_dir: str = ""
    # prefill refused or aborted a room -> decode acted on the notice: seconds, from the servers' decision lines
    notify_latency: dict[str, Any] = field(default_factory=dict)
    forged_control: dict[str, Any] = field(default_factory=dict)
    # late room -> the request decoding over its pages when the write was landed (rooms absent: landed on timer)
    late_write_landings: dict[str, str] = field(default_factory=dict)

    def violations(self) -> list[str]:
        """What a hardened run must never show (empty: the run held every promise the soak checks)."""
        out = []
        served = int(self.summary["by_outcome"].get("ok", 0))
        if self.foreign_reads is None:
            out.append("no KV tracer: foreign reads not judged")
        elif self.foreign_reads["rows"] or self.foreign_reads["tracer_errors"]:
            out.append(f"foreign reads: {self.foreign_reads}")
        elif int(self.foreign_reads.get("traced_first_decodes", 0)) < TRACED_SHARE * served:
            out.append(f"the KV tracer saw {self.foreign_reads['traced_first_decodes']} first decode step(s) for "
                       f"{served} request(s) served: under {TRACED_SHARE:.0%}, so 0 foreign reads proves nothing")
        if self.forged_control.get("accepted"):
            out.append(f"the control plane accepted {self.forged_control['accepted']} forged request(s): "
                       f"{self.forged_control['by_route']}")
        by = self.summary["by_outcome"]
        for bad in ("oversized_served", "failed", "oversized_unanswered", "oversized_failed"):
            if by.get(bad):
                out.append(f"{by[bad]} request(s) {bad}")
        if self.summary["refused_over_bound"]:
            out.append(f"{self.summary['refused_over_bound']} refusal(s) slower than the bound")
        bound = int(self.summary["quarantine_bound_pages"])
        if self.summary["quarantine_max_pages"] > bound:
            out.append(f"quarantine peaked at {self.summary['quarantine_max_pages']} pages"
                       f" ({self.summary['quarantine_max_share']:.2%} of a decode pool; bound {bound} pages)")
        for role, q in self.quiesce.items():
            if q["leaked_tokens"] is None:
                out.append(f"{role}: pool not readable at quiesce (server down?): leaks and double frees unchecked")
            elif q["leaked_tokens"]:
                out.append(f"{role}: {q['leaked_tokens']} token(s) of KV not back at quiesce")
            if q["double_frees"]:
                out.append(f"{role}: {q['double_frees']} page(s) freed twice")
            if q.get("quarantined_pages"):
                out.append(f"{role}: {q['quarantined_pages']} page(s) still in quarantine at quiesce")
        return out

    def control_fired(self) -> bool:
        """A vanilla run showed the harm the guards prevent: foreign KV rows read, or an oversized prompt served."""
        return bool((self.foreign_reads or {}).get("rows")) or bool(self.summary["by_outcome"].get("oversized_served"))

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "violations": self.violations()}
