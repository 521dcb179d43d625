"""Run the fleet's alert rules (``deploy/prometheus/sglang-harden-rules.yml``) over given series with ``promtool test
rules``, and turn a real server's ``/metrics`` into such series.

A scenario is the series of some nodes (``name{labels}`` -> promtool's expanding notation, one sample per
interval), the minute at which the rules are evaluated, and the alerts expected then (``{alert: [labels]}``);
every other alert it judges (all of them unless it lists them) must stay silent. Needs PyYAML (the rules'
annotations) and ``promtool`` (``scripts/fetch_promtool.sh``).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RULES_FILE = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "sglang-harden-rules.yml"
SCRAPE_JOB = "sglang"  # the rules take jobs named sglang* for SGLang servers
COUNTED_AT_MINUTE = 20  # a scraped counter's value appears at this minute (0 before): its increase is news then
SAMPLES = 600

_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


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
        match = _SAMPLE.match(line)
        if match is None or line.startswith("#"):
            continue
        name = match.group("name")
        if not name.startswith("sglang_harden_") or name.endswith("_created"):
            continue
        labels = tuple(sorted(_LABEL.findall(match.group("labels") or "")))
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
