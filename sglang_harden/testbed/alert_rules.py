"""Run the fleet's alert rules (``deploy/prometheus/sglang-harden-rules.yml``) over given series with ``promtool test
rules``, and turn a real server's ``/metrics`` into such series.

A scenario is the series of some nodes (``name{labels}`` -> promtool's expanding notation, one sample per
interval), the minute at which the rules are evaluated, and the alerts expected then (``{alert: [labels]}``);
every other alert it judges (all of them unless it lists them) must stay silent. Needs PyYAML (the rules'
annotations) and ``promtool`` (``scripts/fetch_promtool.sh``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sglang_harden.tools.audit import LABEL_RE, SAMPLE_RE

RULES_FILE = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "sglang-harden-rules.yml"
SCRAPE_JOB = "sglang"  # the rules take jobs named sglang* for SGLang servers
COUNTED_AT_MINUTE = 20  # a scraped counter's value appears at this minute (0 before): its increase is news then
# the second scrape's values are in force from minute COUNTED_AT_MINUTE + 1: judged 7 minutes on, a condition it
# brought has held past the rules' 5-minute ``for`` (quarantine near the cap) and the 10-minute increase windows
# still hold its counters' step (judged 5 minutes on, a quarantine from the second scrape was 4 minutes old: no alert)
JUDGED_AT_MINUTE = COUNTED_AT_MINUTE + 7
SAMPLES = 600
# The alerts on a counter of decisions: (alert, guards, decisions, severity).
COUNTER_ALERTS = (
    ("SGLangHardenAuthRefusals", ("bootstrap_auth", "zmq_auth"), ("reject", "reject_logged"), "warning"),
    ("SGLangHardenIntegrityAbort", ("checksum", "canary", "page_tags", "coverage"), ("abort", "abort_logged"),
     "critical"),
)
# SGLangHardenNotEnforcing waits 7 days: judged on hourly samples, after 8 days.
WEEK_INTERVAL, WEEK_EVAL_MINUTES = "1h", 8 * 24 * 60
DECISIONS = "sglang_harden_guard_decisions_total"
BUILD_INFO = "sglang_harden_build_info"


@dataclass
class Scenario:
    name: str
    series: dict[str, str]
    eval_minute: int
    expected: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    interval: str = "1m"
    checked: frozenset[str] | None = None  # the alerts this scenario judges (None: every alert of the rules)


def selector(name: str, **labels: str) -> str:
    return name + "{" + ",".join(f'{key}="{value}"' for key, value in sorted(labels.items())) + "}"


def promtool() -> str | None:
    return shutil.which("promtool")


def rules(rules_file: Path = RULES_FILE) -> list[dict[str, Any]]:
    import yaml

    return [rule for group in yaml.safe_load(rules_file.read_text())["groups"] for rule in group["rules"]]


def series_from_scrapes(before: str | None, after: str, instance: str, job: str = SCRAPE_JOB) -> dict[str, str]:
    """Two scrapes of one ``/metrics`` page (``before``: ``None`` for none) as promtool series on ``instance``:
    ``up{instance,job} 1`` throughout (what Prometheus adds for a target it scrapes), and each ``sglang_harden_*``
    sample at its ``before`` value (absent where ``before`` lacked it) until :data:`COUNTED_AT_MINUTE`, at its
    ``after`` value from then on."""
    first, last = _samples(before or ""), _samples(after)
    series = {selector("up", instance=instance, job=job): f"1x{SAMPLES}"}
    for key in sorted(first.keys() | last.keys()):
        name, labels = key
        head = f"{first[key]:g}x{COUNTED_AT_MINUTE}" if key in first else f"_x{COUNTED_AT_MINUTE}"
        tail = f" {last[key]:g}x{SAMPLES - COUNTED_AT_MINUTE - 1}" if key in last else ""
        series[selector(name, **dict(labels), instance=instance)] = head + tail
    return series


def _samples(exposition: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for line in exposition.splitlines():
        match = SAMPLE_RE.match(line)
        if match is None or line.startswith("#"):
            continue
        name = match.group("name")
        if not name.startswith("sglang_harden_") or name.endswith("_created"):
            continue
        labels = tuple(sorted(LABEL_RE.findall(match.group("labels") or "")))
        samples[(name, labels)] = float(match.group("value"))
    return samples


def _unit_tests(rules_file: Path, scenarios: list[Scenario], interval: str) -> dict[str, Any]:
    annotations = {rule["alert"]: rule.get("annotations", {}) for rule in rules(rules_file)}
    tests = [{
        "name": scenario.name,
        "interval": interval,
        "input_series": [{"series": key, "values": values} for key, values in scenario.series.items() if values],
        "alert_rule_test": [
            {"eval_time": f"{scenario.eval_minute}m", "alertname": alert,
             "exp_alerts": [{"exp_labels": labels, "exp_annotations": annotations[alert]}
                            for labels in scenario.expected.get(alert, [])]}
            for alert in annotations if scenario.checked is None or alert in scenario.checked
        ],
    } for scenario in scenarios]
    return {"rule_files": [str(rules_file)], "evaluation_interval": interval, "tests": tests}


def run(scenarios: list[Scenario], work_dir: Path, rules_file: Path = RULES_FILE) -> subprocess.CompletedProcess[str]:
    """``promtool test rules`` over ``scenarios`` (one file per sampling interval); raises without promtool."""
    tool = promtool()
    if tool is None:
        raise FileNotFoundError("promtool not installed (scripts/fetch_promtool.sh fetches it)")
    files = []
    for interval in sorted({scenario.interval for scenario in scenarios}):
        chosen = [scenario for scenario in scenarios if scenario.interval == interval]
        path = work_dir / f"{rules_file.stem}.{interval}.test.yml"
        path.write_text(json.dumps(_unit_tests(rules_file, chosen, interval), indent=1))  # JSON is YAML
        files.append(str(path))
    return subprocess.run([tool, "test", "rules", *files], capture_output=True, text=True, timeout=120, check=False)


def scrape(url: str, timeout: float = 10.0) -> str:
    """A server's ``/metrics`` page."""
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as response:
        return str(response.read().decode())


@dataclass
class NodeJudgement:
    """What the rules said over some real nodes, and what each node's own samples call for."""

    result: subprocess.CompletedProcess[str]
    expected: dict[str, list[dict[str, str]]]

    @property
    def ok(self) -> bool:
        return self.result.returncode == 0


def expected_alerts(instance: str, before: str | None, after: str) -> dict[str, list[dict[str, str]]]:
    """The alerts one node's two scrapes call for, read off its own samples: each counter alert where a decision
    of its guards grew between the scrapes; QuarantineNearCap where a scheduler holds 80 % of its cap;
    GuardsNotArmed / NotEnforcing where the build info says mode ``none`` / ``log`` or ``mixed``; Missing where
    there is no build info."""
    first, last = _samples(before or ""), _samples(after)
    expected: dict[str, list[dict[str, str]]] = {alert: [] for alert, *_ in COUNTER_ALERTS}
    grown: set[tuple[str, str]] = set()
    for (name, labels), value in last.items():
        pairs = dict(labels)
        if name == DECISIONS and value > first.get((name, labels), 0.0):
            grown.add((pairs.get("guard", ""), pairs.get("decision", "")))
    for alert, guards, decisions, severity in COUNTER_ALERTS:
        expected[alert] = [{"instance": instance, "guard": guard, "decision": decision, "severity": severity}
                           for guard, decision in sorted(grown) if guard in guards and decision in decisions]
    quarantined = {dict(labels).get("pid"): value for (name, labels), value in last.items()
                   if name == "sglang_harden_quarantined_pages"}
    caps = {dict(labels).get("pid"): value for (name, labels), value in last.items()
            if name == "sglang_harden_quarantine_cap_pages"}
    near = any(cap > 0 and quarantined.get(pid, 0.0) / cap >= 0.8 for pid, cap in caps.items())
    expected["SGLangHardenQuarantineNearCap"] = [{"instance": instance, "severity": "warning"}] if near else []
    builds = {labels: value for (name, labels), value in last.items() if name == BUILD_INFO and value == 1}
    unarmed = {(dict(labels)["role"], dict(labels)["pin"]) for labels in builds if dict(labels)["mode"] == "none"}
    expected["SGLangHardenGuardsNotArmed"] = [{"instance": instance, "role": role, "pin": pin, "severity": "critical"}
                                              for role, pin in sorted(unarmed)]
    lenient = {(dict(labels)["role"], dict(labels)["mode"]) for labels in builds
               if dict(labels)["mode"] in ("log", "mixed")}
    expected["SGLangHardenNotEnforcing"] = [{"instance": instance, "role": role, "mode": mode, "severity": "info"}
                                            for role, mode in sorted(lenient)]
    expected["SGLangHardenMissing"] = [] if builds else [{"instance": instance, "severity": "critical"}]
    return expected


def judge_nodes(scrapes: Mapping[str, tuple[str | None, str]], work_dir: Path) -> NodeJudgement:
    """Every alert of the rules over real nodes (``{instance: (first scrape or None, last scrape)}``), each expected
    exactly where :func:`expected_alerts` says: the NotEnforcing week on hourly samples, the rest on minutes."""
    series: dict[str, str] = {}
    expected: dict[str, list[dict[str, str]]] = {}
    for instance, (before, after) in sorted(scrapes.items()):
        series.update(series_from_scrapes(before, after, instance))
        for alert, labels in expected_alerts(instance, before, after).items():
            expected.setdefault(alert, []).extend(labels)
    week = "SGLangHardenNotEnforcing"
    minutes = {alert: labels for alert, labels in expected.items() if alert != week}
    scenarios = [
        Scenario("real nodes", series, JUDGED_AT_MINUTE, minutes, checked=frozenset(minutes)),
        Scenario("real nodes, a week on", series, WEEK_EVAL_MINUTES, {week: expected[week]}, interval=WEEK_INTERVAL,
                 checked=frozenset({week})),
    ]
    return NodeJudgement(run(scenarios, work_dir), expected)
