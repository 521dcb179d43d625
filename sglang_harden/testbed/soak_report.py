"""Telling a soak run: the outcomes file, the stories a failed run's message shows (from the servers' logs), the
vanilla/hardened table and ratios, and the progress line."""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sglang_harden.testbed.decisions import decision_lines
from sglang_harden.testbed.soak_judging import SoakReport
from sglang_harden.testbed.soak_spec import Outcome


def write_outcomes(path: Path, outcomes: list[Outcome]) -> None:
    """Every request's outcome, one JSON line each (kind, rid, status, latency, send time, verdict)."""
    with path.open("w") as out:
        for outcome in outcomes:
            out.write(json.dumps({**asdict(outcome), "verdict": outcome.verdict}) + "\n")


def lifecycle_story(log_dir: Path, limit: int = 30) -> list[str]:
    """The lifecycle guard's decisions of a run from every server log, in time order (the last ``limit``): what a
    failed run's message shows, so the cause of a quarantine or of a page not back can be read off CI's output."""
    told = []
    for path in sorted(log_dir.glob("*.log")):
        for d in decision_lines(path.read_text(errors="replace")):
            if d.get("guard") == "lifecycle" and d.get("decision") != "allow":
                who = d.get("owner") or f"room:{d.get('room')}"
                told.append((float(d.get("ts") or 0.0), f"{d.get('ts')} {path.stem} {d.get('decision')} {who} "
                                                        f"pages={d.get('pages')} {str(d.get('reason'))[:90]}"))
    return [line for _, line in sorted(told)[-limit:]]


# prefill's digest post did not reach its board (decode then refuses the room: nothing vouches for its KV)
DIGEST_POST_ERROR = re.compile(r"sglang-harden: (publishing the digest|the bootstrap server refused the digest|"
                               r"\d+ digests are waiting)")


def failure_story(report: SoakReport, limit: int = 20) -> list[str]:
    """Why requests failed: each failed request (status, error) and every guard decision that was not ``allow``
    and is not routine traffic (a checksum abort, a coverage refusal, ...), with its reason,
    from every server log: what a failed run's message shows, so the cause can be read off CI's output."""
    told = [f"failed: {e.get('kind')} rid={e.get('rid')} status={e.get('status')} sent_at={e.get('sent_at')} "
            f"error={str(e.get('error'))[:200]}" for e in report.summary.get("failed_examples", [])]
    # abort notices, oversized prompts refused, and the soak's own forged control requests (counted in the table)
    routine = {("abort_notify", "abort"), ("abort_notify", "release"), ("admission", "reject"),
               ("bootstrap_auth", "reject")}
    lines, errors = [], []
    for path in sorted(Path(report.log_dir).glob("*.log")):
        text = path.read_text(errors="replace")
        errors += [f"{path.stem}: {line[:240]}" for line in text.splitlines() if DIGEST_POST_ERROR.search(line)]
        for d in decision_lines(text):
            if d.get("decision") == "allow" or (d.get("guard"), d.get("decision")) in routine:
                continue
            lines.append((float(d.get("ts") or 0.0), f"{d.get('ts')} {path.stem} {d.get('guard')}:{d.get('decision')}"
                                                     f" rid={d.get('rid')} {str(d.get('reason'))[:240]}"))
    return told + [line for _, line in sorted(lines)[-limit:]] + errors[-limit:]


def compare(vanilla: SoakReport, hardened: SoakReport) -> dict[str, float | None]:
    """hardened/vanilla ratios under the same load (throughput: higher is better; latency: lower is better)."""

    def ratio(key: str) -> float | None:
        v, h = vanilla.summary.get(key), hardened.summary.get(key)
        return round(h / v, 3) if v and h is not None else None

    keys = ("throughput_tokens_per_s", "throughput_requests_per_s", "latency_p50_s", "latency_p99_s",
            "ttft_p50_s", "ttft_p99_s")
    return {key: ratio(key) for key in keys}


def render(reports: list[SoakReport], ratios: dict[str, float | None] | None) -> str:
    rows = [
        ("requests", lambda r: r.summary["requests"]),
        ("outcomes", lambda r: " ".join(f"{k}={v}" for k, v in r.summary["by_outcome"].items())),
        ("foreign reads (rows / requests)",
         lambda r: "not traced" if r.foreign_reads is None else
         f"{r.foreign_reads['rows']} / {r.foreign_reads['requests']}"),
        ("  of which unfinished owners / partial rows",
         lambda r: "-" if r.foreign_reads is None else
         f"{r.foreign_reads.get('rows_of_unfinished_owners', 0)} / {r.foreign_reads.get('partial_rows', 0)}"),
        ("  first decode steps traced", lambda r: "-" if r.foreign_reads is None else
         str(r.foreign_reads.get("traced_first_decodes", 0))),
        ("refusals by guard", lambda r: " ".join(f"{node}:{k}={v}" for node, d in r.refusals_by_guard.items()
                                                 for k, v in d.items()) or "-"),
        ("max time to refuse (s)", lambda r: _fmt(r.summary["refused_max_s"])),
        ("decode told of refusal p50/max (s)",
         lambda r: f"{_fmt(r.notify_latency.get('p50_s'))}/{_fmt(r.notify_latency.get('max_s'))}"),
        ("late writes landed on a victim", _landings),
        ("quarantine max (pages, share; bound)",
         lambda r: f"{r.summary['quarantine_max_pages']} ({r.summary['quarantine_max_share']:.2%};"
                   f" {r.summary.get('quarantine_bound_pages', '-')})"),
        ("leaked at quiesce (tokens p/d)", lambda r: _per_role(r.quiesce, "leaked_tokens")),
        ("double frees (p/d)", lambda r: _per_role(r.quiesce, "double_frees")),
        ("throughput (tok/s)", lambda r: _fmt(r.summary["throughput_tokens_per_s"])),
        ("latency p50/p99 (s)", lambda r: f"{_fmt(r.summary['latency_p50_s'])}/{_fmt(r.summary['latency_p99_s'])}"),
        ("TTFT p50/p99 (s)", lambda r: f"{_fmt(r.summary['ttft_p50_s'])}/{_fmt(r.summary['ttft_p99_s'])}"),
        ("forged control (sent/401/accepted)",
         lambda r: "-" if not r.forged_control else
         f"{r.forged_control['sent']}/{r.forged_control['refused_401']}/{r.forged_control['accepted']}"),
        ("violations", lambda r: len(r.violations())),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"{'':<{width}}  " + "  ".join(f"{r.variant:<28}" for r in reports)]
    for name, get in rows:
        lines.append(f"{name:<{width}}  " + "  ".join(f"{str(get(r)):<28}" for r in reports))
    if ratios:
        lines.append("hardened/vanilla: " + ", ".join(f"{k} {_fmt(v)}" for k, v in ratios.items()))
    for report in reports:
        for violation in report.violations():
            lines.append(f"{report.variant}: {violation}")
    return "\n".join(lines)


def _landings(report: SoakReport) -> str:
    late = report.load.get("late_writes")
    return f"{len(report.late_write_landings)} of {late}" if late else "-"


def _per_role(per_node: dict[str, dict[str, Any]], key: str) -> str:
    """``<prefill total>/<decode total>`` of ``key`` over every node of each role."""
    totals = [sum(int(numbers.get(key) or 0) for name, numbers in per_node.items() if name.startswith(role))
              for role in ("prefill", "decode")]
    return f"{totals[0]}/{totals[1]}"


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


def progress_line(prefix: str, every_s: float = 10.0) -> Callable[[str], None]:
    """A progress bar on a terminal (redrawn in place); one line per ``every_s`` seconds in a log."""
    last = [0.0]

    def say(msg: str) -> None:
        if sys.stderr.isatty():
            print(f"\r[soak {prefix}] {msg}", file=sys.stderr, end="", flush=True)
        elif time.monotonic() - last[0] >= every_s:
            last[0] = time.monotonic()
            print(f"[soak {prefix}] {msg}", file=sys.stderr, flush=True)

    return say
