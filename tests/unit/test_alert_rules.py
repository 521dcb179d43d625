"""The alert rules and the dashboard (``deploy/prometheus/``, ``deploy/grafana/``) against what the plugin exports.

- ``promtool check rules`` accepts the rules and rejects a copy with one expression broken (the check can fail);
- every series the scenarios below feed the rules (metric, label names and values, instance aside) is a sample the
  plugin's own code puts on ``/metrics`` (``sglang_harden.events`` through prometheus_client), and every
  ``sglang_harden_*`` metric the rules and the dashboard query is one it exports;
- ``promtool test rules``: each alert fires on the series of its condition, and none fires on a healthy node's;
  with any one alert's expression replaced by one that never fires, or always fires, the same test fails.

Runs in a pin venv (prometheus_client, PyYAML): ``scripts/run_tests.sh`` lists it with the torch tests.
promtool: ``scripts/fetch_promtool.sh`` (``scripts/run_tests.sh`` puts it on ``PATH``).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from sglang_harden import events
from sglang_harden.config import Mode
from sglang_harden.guards import bootstrap_auth, canary, checksum, coverage, page_tags, zmq_auth
from sglang_harden.guards.base import Decision, Verdict, allow
from sglang_harden.testbed import alert_rules
from sglang_harden.testbed.alert_rules import Scenario

prometheus_client = pytest.importorskip("prometheus_client")
yaml = pytest.importorskip("yaml")

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "sglang-harden.json"
RULES = alert_rules.RULES_FILE
DECISIONS = events.METRIC_NAME + "_total"
BUILD = {"version": "0.1.0", "pin": "0.5.23", "family": "sglang-0.5.19+", "role": "scheduler/decode"}
_series = alert_rules.selector


def _promtool() -> str:
    found = alert_rules.promtool()
    if found is None:
        pytest.skip("promtool not installed (scripts/fetch_promtool.sh fetches it, scripts/run_tests.sh runs that)")
    return found


def _healthy_node(instance: str) -> dict[str, str]:
    """A hardened node at work: enforcing, allowing, nothing quarantined (one sample a minute)."""
    return {
        _series(events.BUILD_INFO_NAME, instance=instance, mode="enforce", **BUILD): "1x600",
        _series(DECISIONS, instance=instance, guard=checksum.GUARD, decision="allow", mode="enforce"): "0+10x600",
        # primed at start-up (compat/runtime.py WATCHED_DECISIONS)
        _series(DECISIONS, instance=instance, guard=checksum.GUARD, decision="abort", mode="enforce"): "0x600",
        _series(DECISIONS, instance=instance, guard=bootstrap_auth.GUARD, decision="reject", mode="enforce"): "0x600",
        _series(events.GAUGE_NAME, instance=instance): "0x600",
        _series(events.CAP_GAUGE_NAME, instance=instance): "64x600",
        _series("up", instance=instance, job="sglang-decode"): "1x600",
    }


def _counted_at_minute_20(instance: str, guard: str, decision: str) -> dict[str, str]:
    mode = "log" if decision.endswith("_logged") else "enforce"
    return {_series(DECISIONS, instance=instance, guard=guard, decision=decision, mode=mode): "0x20 1x580"}


def _without_build_info(node: dict[str, str]) -> dict[str, str]:
    return {key: values for key, values in node.items() if not key.startswith(events.BUILD_INFO_NAME)}


def _node_in_modes(**build_info_by_mode: str) -> dict[str, str]:
    """Node "a" of :func:`_healthy_node` whose build info has these samples per mode instead of enforce throughout."""
    return {**_without_build_info(_healthy_node("a")),
            **{_series(events.BUILD_INFO_NAME, instance="a", mode=mode, **BUILD): values
               for mode, values in build_info_by_mode.items()}}


NOT_ENFORCING = {"SGLangHardenNotEnforcing": [{"instance": "a", "role": BUILD["role"], "mode": "log",
                                               "severity": "info"}]}


def _without_gauges(node: dict[str, str]) -> dict[str, str]:
    return {key: values for key, values in node.items()
            if not key.startswith((events.GAUGE_NAME + "{", events.CAP_GAUGE_NAME + "{"))}


SCENARIOS = [
    Scenario("healthy", _healthy_node("a"), 30),
    Scenario("integrity aborts, enforced and logged",
             {**_healthy_node("a"), **_counted_at_minute_20("a", checksum.GUARD, "abort"),
              **_counted_at_minute_20("a", page_tags.GUARD, "abort_logged")}, 25,
             {"SGLangHardenIntegrityAbort": [
                 {"instance": "a", "guard": checksum.GUARD, "decision": "abort", "severity": "critical"},
                 {"instance": "a", "guard": page_tags.GUARD, "decision": "abort_logged", "severity": "critical"}]}),
    Scenario("an abort whose sample did not exist at 0 before is not seen (why the plugin primes it)",
             {**_healthy_node("a"),
              _series(DECISIONS, instance="a", guard=checksum.GUARD, decision="abort", mode="enforce"): "_x20 1x579"},
             25),
    Scenario("an integrity abort is news for ten minutes",
             {**_healthy_node("a"), **_counted_at_minute_20("a", canary.GUARD, "abort")}, 40),
    Scenario("auth refusals",
             {**_healthy_node("a"), **_counted_at_minute_20("a", bootstrap_auth.GUARD, "reject"),
              **_counted_at_minute_20("a", zmq_auth.GUARD, "reject_logged")}, 25,
             {"SGLangHardenAuthRefusals": [
                 {"instance": "a", "guard": bootstrap_auth.GUARD, "decision": "reject", "severity": "warning"},
                 {"instance": "a", "guard": zmq_auth.GUARD, "decision": "reject_logged", "severity": "warning"}]}),
    Scenario("quarantine near the cap",
             {**_healthy_node("a"), _series(events.GAUGE_NAME, instance="a"): "0x10 52x590"}, 30,
             {"SGLangHardenQuarantineNearCap": [{"instance": "a", "severity": "warning"}]}),
    Scenario("quarantine below 80 % of the cap",
             {**_healthy_node("a"), _series(events.GAUGE_NAME, instance="a"): "0x10 50x590"}, 30),
    Scenario("one of two decode schedulers near its cap (the other empty)",
             {**_without_gauges(_healthy_node("a")),
              _series(events.GAUGE_NAME, instance="a", pid="11"): "0x10 52x590",
              _series(events.CAP_GAUGE_NAME, instance="a", pid="11"): "64x600",
              _series(events.GAUGE_NAME, instance="a", pid="12"): "0x600",
              _series(events.CAP_GAUGE_NAME, instance="a", pid="12"): "64x600"}, 30,
             {"SGLangHardenQuarantineNearCap": [{"instance": "a", "severity": "warning"}]}),
    Scenario("no guard armed", _node_in_modes(none="1x600"), 30,
             {"SGLangHardenGuardsNotArmed": [
                 {"instance": "a", "role": BUILD["role"], "pin": BUILD["pin"], "severity": "critical"}]}),
    # an hour between samples: eight days of minutes take promtool a minute
    Scenario("log mode for eight days", _node_in_modes(log="1x600"), 8 * 24 * 60, NOT_ENFORCING, interval="1h"),
    Scenario("log mode for eight days, restarted once (an hour without samples)",
             _node_in_modes(log="1x100 _ 1x500"), 8 * 24 * 60, NOT_ENFORCING, interval="1h"),
    Scenario("log mode for six days, then enforce", _node_in_modes(log="1x144", enforce="_x144 1x400"), 8 * 24 * 60,
             interval="1h"),
    Scenario("an SGLang node without the plugin, and a target of another job",
             {**_healthy_node("a"), _series("up", instance="b", job="sglang-prefill"): "1x600",
              _series("up", instance="c", job="node-exporter"): "1x600"}, 30,
             {"SGLangHardenMissing": [{"instance": "b", "severity": "critical"}]}),
    Scenario("an SGLang node without the plugin that is down",
             {**_healthy_node("a"), _series("up", instance="b", job="sglang-prefill"): "0x600"}, 30),
]


def _run_unit_tests(rules_file: Path, work_dir: Path) -> subprocess.CompletedProcess[str]:
    _promtool()
    return alert_rules.run(SCENARIOS, work_dir, rules_file)


def _exported_samples() -> set[str]:
    """``name{labels}`` of every sglang_harden sample the plugin's code exports after one decision of each kind
    the scenarios use (prometheus_client's own exposition)."""
    for guard, verdict in ((checksum.GUARD, Verdict.ABORT), (page_tags.GUARD, Verdict.ABORT),
                           (canary.GUARD, Verdict.ABORT), (coverage.GUARD, Verdict.ABORT),
                           (bootstrap_auth.GUARD, Verdict.REJECT), (zmq_auth.GUARD, Verdict.REJECT)):
        for mode in (Mode.ENFORCE, Mode.LOG):
            events.record(Decision(guard, verdict, "alert rule test"), mode, quiet=True)
    events.record(allow(checksum.GUARD), Mode.ENFORCE)
    events.set_quarantined_pages(0, 64)
    for mode in ("enforce", "none", "log"):
        events.publish_build_info(mode=mode, **BUILD)
    exposition = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
    samples = set()
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name.startswith("sglang_harden_"):
                samples.add(_series(sample.name, **sample.labels))
    return samples


def _as_exported(selector: str) -> str:
    """The selector without what the scrape adds: ``instance``, and ``pid`` (SGLang's multiprocess collector)."""
    return re.sub(r'(?<=[{,])(?:instance|pid)="[^"]*",?', "", selector).replace(",}", "}")


def test_promtool_accepts_the_rules_and_rejects_a_broken_copy(tmp_path: Path) -> None:
    checked = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True,
                             timeout=60, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    broken = tmp_path / "broken.yml"
    broken.write_text(RULES.read_text().replace("(increase(", "(increase((", 1))  # one unbalanced parenthesis
    assert broken.read_text() != RULES.read_text()
    rejected = subprocess.run([_promtool(), "check", "rules", str(broken)], capture_output=True, text=True,
                              timeout=60, check=False)
    assert rejected.returncode != 0, rejected.stdout


def test_the_scenarios_feed_only_what_the_plugin_exports() -> None:
    exported = _exported_samples()
    fed = {_as_exported(key) for scenario in SCENARIOS for key in scenario.series
           if key.startswith("sglang_harden_")}
    assert fed, "no sglang_harden series in the scenarios"
    assert fed <= exported, sorted(fed - exported)
    exported_names = {sample.split("{", 1)[0] for sample in exported}
    queried = set(re.findall(r"sglang_harden_[a-z_]+", RULES.read_text() + DASHBOARD.read_text()))
    assert queried and queried <= exported_names, sorted(queried - exported_names)


def test_each_alert_fires_on_its_condition_and_not_on_a_healthy_node(tmp_path: Path) -> None:
    alerts = {rule["alert"] for rule in alert_rules.rules()}
    fired = {alert for scenario in SCENARIOS for alert in scenario.expected}
    assert fired == alerts, f"alerts no scenario fires: {sorted(alerts - fired)}"
    result = _run_unit_tests(RULES, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("alert", [rule["alert"] for rule in alert_rules.rules()])
@pytest.mark.parametrize("mutation", ["never fires", "always fires"])
def test_the_scenarios_fail_when_an_alert_is_broken(tmp_path: Path, alert: str, mutation: str) -> None:
    """The same scenarios fail with the alert's expression replaced by one that never fires, or always does."""
    document = yaml.safe_load(RULES.read_text())
    for group in document["groups"]:
        for rule in group["rules"]:
            if rule["alert"] == alert:
                rule["expr"] = "vector(1) < 0" if mutation == "never fires" else "vector(1)"
    mutated = tmp_path / "mutated.yml"
    mutated.write_text(yaml.safe_dump(document, sort_keys=False))
    result = _run_unit_tests(mutated, tmp_path)
    assert result.returncode != 0, f"promtool's test passed with {alert} broken ({mutation})"
    assert alert in result.stdout + result.stderr


def test_every_decision_the_rules_count_is_primed_at_start_up() -> None:
    """An alert on a decision's increase sees its first occurrence only when the sample existed at 0 before:
    every guard and decision the rules count is one the start-up primes (compat/runtime.py WATCHED_DECISIONS)."""
    from sglang_harden.compat.runtime import WATCHED_DECISIONS

    counted = set()
    for expr in (rule["expr"] for rule in alert_rules.rules() if DECISIONS in rule["expr"]):
        guards = re.search(r'guard=~"([^"]+)"', expr)
        decisions = re.search(r'decision=~"([^"]+)"', expr)
        assert guards and decisions, expr
        counted |= {(guard, decision.removesuffix("_logged"))
                    for guard in guards.group(1).split("|") for decision in decisions.group(1).split("|")}
    assert counted == {(guard, verdict.value) for guard, verdict in WATCHED_DECISIONS.items()}


def test_real_node_judging_sees_a_quarantine_the_second_scrape_brought(tmp_path: Path) -> None:
    """judge_nodes over two expositions of one decode: nothing held at the first scrape, 10 pages of a 12-page cap at
    the second. The rules fire SGLangHardenQuarantineNearCap where the samples call for it (and not at 9 pages, 75%)."""
    def exposition(pages: int) -> str:
        return "\n".join([
            'sglang_harden_build_info{family="sglang-0.5.19+",mode="enforce",pin="0.5.23",role="decode",'
            'version="0.1.0",pid="7"} 1',
            f'sglang_harden_quarantined_pages{{pid="7"}} {pages}',
            'sglang_harden_quarantine_cap_pages{pid="7"} 12', ""])

    for pages, fires in ((10, True), (9, False)):
        (tmp_path / str(pages)).mkdir()
        judged = alert_rules.judge_nodes({"decode": (exposition(0), exposition(pages))}, tmp_path / str(pages))
        near = judged.expected["SGLangHardenQuarantineNearCap"]
        assert near == ([{"instance": "decode", "severity": "warning"}] if fires else []), (pages, near)
        assert judged.ok, judged.result.stdout + judged.result.stderr
