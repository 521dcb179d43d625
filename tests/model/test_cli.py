import json

from sglang_harden.cli import main


def test_vanilla_incident_json_reports_counterexample(capsys):
    argv = ["model", "check", "--policy", "vanilla", "--scenario", "incident", "--no-client-events"]
    assert main(argv + ["--no-timeouts", "--json", "--all"]) == 1
    payload = json.loads(capsys.readouterr().out)
    props = {v["property"] for v in payload["violations"]}
    assert {"stale_read", "rejected_completed"} <= props
    assert payload["states"] > 0 and payload["exhausted"]


def test_hardened_incident_prints_states_and_no_violation(capsys):
    assert main(["model", "check", "--policy", "hardened", "--scenario", "incident"]) == 0
    out = capsys.readouterr().out
    assert "distinct states" in out and "violations: none" in out


def test_disable_prints_counterexample_and_unmodelled_note(capsys):
    argv = ["model", "check", "--scenario", "incident", "--disable", "abort_notify,checksum"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "stuck_until_timeout" in out and "note: checksum is not expressed" in out


def test_unknown_guard_is_an_error(capsys):
    assert main(["model", "check", "--disable", "nonsense"]) == 2
