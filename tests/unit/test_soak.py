"""The soak's judging, without servers: verdicts, oracles over tracer events, quiesce numbers, ratios, CLI input."""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import pytest

from sglang_harden.testbed import soak_judging, soak_load, soak_report, soak_requests, soak_spec
from sglang_harden.testbed.procenv import SHIMS_DIR
from sglang_harden.tools import soak as soak_tool

LOAD = soak_spec.SoakLoad(duration_s=10.0)
TOPO = soak_spec.SoakTopology(pin="0.5.19")
TARGET = soak_requests.Target({"prefill": "http://127.0.0.1:9", "decode": "http://127.0.0.1:9"}, 9)


def _outcome(kind: str, status: int, latency: float = 1.0, tokens: int = 4, wanted: int = 4,
             error: str = "") -> soak_spec.Outcome:
    return soak_spec.Outcome(kind, f"r-{kind}-{status}", status, latency, 0.1, tokens, wanted, error=error)


@pytest.mark.parametrize(
    ("kind", "status", "tokens", "verdict"),
    [
        ("normal", 200, 4, "ok"),
        ("normal", 200, 3, "failed"),  # a short answer is not a success
        ("normal", 503, 0, "failed"),
        ("oversized", 200, 4, "oversized_served"),
        ("oversized", 400, 0, "oversized_failed"),  # an error without the refusing guard's message
        ("oversized", 503, 0, "oversized_failed"),  # a 503 without the guard's message is no refusal
        ("oversized", -1, 0, "oversized_unanswered"),
        ("disconnect", -1, 0, "disconnected"),
    ],
)
def test_verdicts(kind: str, status: int, tokens: int, verdict: str) -> None:
    assert _outcome(kind, status, tokens=tokens).verdict == verdict


def test_failed_transfer_is_collateral_only_when_a_fault_was_injected() -> None:
    message = "KVTransferError(bootstrap_room=7): Failed to get kvcache from prefill instance, it might be dead"
    hit = soak_spec.Outcome("normal", "r", 500, 1.0, None, 0, 4, error=message, faults_injected=True)
    assert hit.verdict == "transfer_failed"
    assert soak_spec.Outcome("normal", "r", 500, 1.0, None, 0, 4, error=message).verdict == "failed"
    other = soak_spec.Outcome("normal", "r", 500, 1.0, None, 0, 4, error="boom", faults_injected=True)
    assert other.verdict == "failed"


def test_burst_aborted_request_is_not_judged_as_failed() -> None:
    outcome = _outcome("normal", 500, tokens=0)
    outcome.aborted_by_burst = True
    assert outcome.verdict == "aborted"


def test_foreign_reads_counts_first_decode_rows_and_rows_changed_while_decoding() -> None:
    trace = [
        {"event": "first_decode", "rid": "a", "foreign_total": 0, "same_prefix_rows": 30},
        {"event": "first_decode", "rid": "b", "foreign_total": 12},
        {"event": "release", "rid": "a", "context_rows_changed": 0},
        {"event": "release", "rid": "c", "context_rows_changed": 5},
        {"event": "release", "rid": "d", "context_rows_changed": None},
        {"event": "first_decode", "rid": "e", "foreign_total": 0, "rows_changed_since_commit": 2},
    ]
    got = soak_judging.foreign_reads(trace)
    assert got["rows"] == 19 and got["requests"] == 3 and got["examples"] == ["b", "c", "e"]
    assert got["traced_first_decodes"] == 3 and got["tracer_errors"] == 0
    assert soak_judging.foreign_reads([{"event": "error", "where": "x"}])["tracer_errors"] == 1


def test_summary_rates_latencies_refusal_bound_and_quarantine_share() -> None:
    outcomes = [_outcome("normal", 200, latency=x) for x in (1.0, 2.0, 3.0, 4.0)]
    too_long = "Input length (700 tokens) exceeds the maximum allowed length (634 tokens)."
    outcomes += [_outcome("oversized", 400, latency=0.3, error=too_long),
                 _outcome("oversized", 400, latency=6.0, error=too_long)]
    samples = [{"decode": {"lifecycle": {"quarantined_pages": q}}} for q in (0, 3, 1)]
    got = soak_judging.summarize(outcomes, samples, 10.0, LOAD, decode_pool_tokens=1600, page_size=16)
    assert got["by_outcome"] == {"ok": 4, "refused": 2}
    assert got["throughput_tokens_per_s"] == 1.6 and got["throughput_requests_per_s"] == 0.4
    assert got["latency_p50_s"] in (2.0, 3.0) and got["latency_p99_s"] == 4.0
    assert got["refused_max_s"] == 6.0 and got["refused_over_bound"] == 1
    assert got["quarantine_max_pages"] == 3 and got["quarantine_max_share"] == 0.03


def _report(**changes: object) -> soak_judging.SoakReport:
    summary = soak_judging.summarize([_outcome("normal", 200)], [], 1.0, LOAD, 1600, 16)
    clean = {"leaked_tokens": 0, "double_frees": 0, "quarantined_pages": 0, "pool": {}}
    fields: dict[str, object] = dict(
        variant="hardened", topology={}, load={}, wall_s=1.0, summary=summary,
        foreign_reads={"rows": 0, "requests": 0, "tracer_errors": 0, "traced_first_decodes": 1},
        quiesce={"prefill": dict(clean), "decode": dict(clean)},
    )
    fields.update(changes)
    return soak_judging.SoakReport(**fields)  # type: ignore[arg-type]


def test_clean_report_has_no_violations_and_each_oracle_can_fail() -> None:
    assert _report().violations() == []
    assert _report(foreign_reads=None).violations() == ["no KV tracer: foreign reads not judged"]
    assert _report(foreign_reads={"rows": 3, "requests": 1, "tracer_errors": 0}).violations()
    assert _report(foreign_reads={"rows": 0, "requests": 0, "tracer_errors": 1}).violations()
    leaked = {"leaked_tokens": 32, "double_frees": 0, "quarantined_pages": 2, "pool": {}}
    assert "decode: 32 token(s)" in _report(quiesce={"prefill": leaked | {"leaked_tokens": 0, "quarantined_pages": 0},
                                                     "decode": leaked}).violations()[0]
    doubled = {"leaked_tokens": 0, "double_frees": 1, "quarantined_pages": 0, "pool": {}}
    assert "freed twice" in _report(quiesce={"prefill": doubled, "decode": doubled}).violations()[0]
    unread = {"leaked_tokens": None, "double_frees": 0, "quarantined_pages": 0, "pool": None}  # a node that died
    assert "prefill1: pool not readable" in _report(quiesce={"prefill1": unread, "decode": doubled | {
        "double_frees": 0}}).violations()[0]
    served = soak_judging.summarize([_outcome("oversized", 200)], [], 1.0, LOAD, 1600, 16)
    assert _report(summary=served).violations() == ["1 request(s) oversized_served"]


def _quarantine_verdict(pages: int, load: soak_spec.SoakLoad, pool_tokens: int) -> list[str]:
    held = [{"decode0": {"lifecycle": {"quarantined_pages": pages}}}]
    return _report(summary=soak_judging.summarize([_outcome("normal", 200)], held, 1.0, load, pool_tokens, 16)
                   ).violations()


def test_quarantine_bound_is_the_pool_share_or_what_the_requests_aborted_at_once_own() -> None:
    # one request of this load owns at most ceil((16 + 32 + 16) / 16) = 4 pages; a burst of one abort, one
    # disconnect beside it: 8
    small = soak_spec.SoakLoad(prefix_len=16, suffix_len=(8, 32), new_tokens=(4, 16), abort_burst_size=1)
    assert small.largest_request_pages(16) == 4
    # a 100-page pool: 2% is 2 pages, under one aborted request; the bound is the 8 pages the aborted ones own
    assert small.quarantine_bound_pages(100, 16) == 8
    assert _quarantine_verdict(8, small, 1600) == []
    assert _quarantine_verdict(9, small, 1600) == [
        "quarantine peaked at 9 pages (9.00% of a decode pool; bound 8 pages)"]
    # a 1000-page pool: the share (20 pages) is the larger bound
    assert small.quarantine_bound_pages(1000, 16) == 20
    assert _quarantine_verdict(20, small, 16000) == []
    assert _quarantine_verdict(21, small, 16000) == [
        "quarantine peaked at 21 pages (2.10% of a decode pool; bound 20 pages)"]
    # each late write may hold its request's pages as well
    assert soak_spec.SoakLoad(prefix_len=16, suffix_len=(8, 32), new_tokens=(4, 16), abort_burst_size=1,
                              late_writes=2).quarantine_bound_pages(100, 16) == 16


def test_pages_left_in_quarantine_at_quiesce_are_a_violation() -> None:
    held = {"leaked_tokens": 0, "double_frees": 0, "quarantined_pages": 3, "pool": {}}
    clean = {"leaked_tokens": 0, "double_frees": 0, "quarantined_pages": 0, "pool": {}}
    assert _report(quiesce={"prefill": clean, "decode": held}).violations() == [
        "decode: 3 page(s) still in quarantine at quiesce"]


def test_leak_of_a_pool_report_and_unreachable_pool() -> None:
    assert soak_judging._leaked({"total": 100, "available": 60, "evictable": 32}) == 8
    assert soak_judging._leaked({"total": 100, "available": 80, "evictable": 32}) == 0
    assert soak_judging._leaked({}) is None


def test_compare_ratios() -> None:
    vanilla = _report(variant="vanilla")
    hardened = _report(summary={**vanilla.summary, "throughput_tokens_per_s": vanilla.summary[
        "throughput_tokens_per_s"] * 0.5})
    ratios = soak_report.compare(vanilla, hardened)
    assert ratios["throughput_tokens_per_s"] == 0.5 and ratios["latency_p50_s"] == 1.0
    assert "hardened/vanilla" in soak_report.render([vanilla, hardened], ratios)


def test_load_mix_and_shared_prefixes() -> None:
    rng = random.Random(0)
    made = [soak_load.make_request(rng, LOAD, TOPO, i, 0) for i in range(2000)]
    kinds = {k: sum(1 for kind, _ in made if kind == k) for k in soak_spec.KINDS}
    assert 50 <= kinds["oversized"] <= 150 and 120 <= kinds["disconnect"] <= 280
    for kind, body in made:
        n = len(body["input_ids"])
        if kind == "oversized":
            assert TOPO.prefill_max_total_tokens < n <= TOPO.context_length
        else:
            assert n + body["sampling_params"]["max_new_tokens"] < TOPO.prefill_max_total_tokens
            assert any(body["input_ids"][: LOAD.prefix_len] == soak_load.tenant_prefix(t, LOAD.prefix_len)
                       for t in range(LOAD.tenants))
    assert len({body["rid"] for _, body in made}) == len(made)


def test_late_write_env_names_each_room_once_and_gives_up_the_engine_call() -> None:
    load = soak_spec.SoakLoad(late_writes=3, late_write_delay_s=6.0)
    env = load.late_write_env()[soak_spec.LATE_WRITE_ENV]
    delay, rooms, timeout, rid_prefix = env.split(":")
    assert float(delay) == 6.0 and timeout == "timeout=1.0" and rid_prefix == f"rid_prefix={soak_spec.LATE_RID_PREFIX}"
    assert [int(r) for r in rooms.split(",")] == load.late_rooms() and len(set(load.late_rooms())) == 3
    assert soak_spec.SoakLoad().late_write_env() == {}
    with_trigger = load.late_write_trigger_env(Path("/t"))[soak_spec.LATE_WRITE_ENV]
    assert with_trigger == f"{env}:trigger=/t/{soak_spec.LATE_TRIGGER}"
    assert _outcome("late_write", 500).verdict == "faulted"


def test_abort_finish_reason_is_not_a_200() -> None:
    assert soak_requests._finish_status({"finish_reason": {"type": "length"}}) == 200
    assert soak_requests._finish_status({"finish_reason": {"type": "abort", "status_code": 503}}) == 503
    assert soak_requests._finish_status({"finish_reason": {"type": "abort"}}) == 500


def _args(**changes: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    soak_tool.add_arguments(parser)
    args = parser.parse_args(["--pin", "0.5.19"])
    for key, value in changes.items():
        setattr(args, key, value)
    return args


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"duration": 0}, "must be positive"),
        ({"decodes": 0}, "must be positive"),
        ({"late_writes": 2, "state": Path("/nonexistent/pair.json")}, "--late-writes needs servers the soak starts"),
        ({"oversized_share": 0.8, "disconnect_share": 0.5}, "add up to at most 1"),
        ({"pin": None}, "give --pin"),
        ({"state": Path("/nonexistent/pair.json")}, "no state file"),
    ],
)
def test_bad_input_is_a_clear_error(changes: dict[str, object], message: str, capsys: pytest.CaptureFixture[str]
                                    ) -> None:
    assert soak_tool.run(_args(**changes)) == 2
    assert message in capsys.readouterr().err


def test_tracer_prefix_keys_tell_shared_prefixes_from_different_ones() -> None:
    sys.path.insert(0, str(SHIMS_DIR))
    try:
        from sglang_harden_kvtrace import prefix_keys
    finally:
        sys.path.remove(str(SHIMS_DIR))
    a, b = prefix_keys([5, 6, 7, 8], 4), prefix_keys([5, 6, 9, 8], 4)
    assert a[:2] == b[:2] and a[2] != b[2] and a[3] != b[3]  # same token later, different prefix: different key
    assert prefix_keys([5, 6, 7], 2) == a[:2]


def test_notify_latency_pairs_prefill_refusal_with_decode_abort_of_the_same_room() -> None:
    from sglang_harden.testbed.decisions import notify_latencies

    def line(**fields: object) -> str:
        import json

        return f"[2026-12-02 02:23:33] sglang_harden.decision {json.dumps(fields)}"

    prefill = "\n".join([
        line(guard="admission", decision="reject", room=7, ts=100.0),
        line(guard="admission", decision="allow", room=8, ts=100.0),
        line(guard="lifecycle", decision="quarantine", room=9, ts=200.0),
        "[2026-12-02 02:23:34] sglang_harden.decision {cut short",
    ])
    decode = "\n".join([
        line(guard="abort_notify", decision="abort", room=7, ts=100.25),
        line(guard="abort_notify", decision="abort", room=7, ts=103.0),  # the first one counts
        line(guard="coverage", decision="abort", room=9, ts=201.0),  # not a notice
        line(guard="abort_notify", decision="abort", room=8, ts=100.5),  # prefill allowed 8: not a refusal
    ])
    assert notify_latencies([prefill], [decode]) == {7: 0.25}


def test_quarantined_pages_are_summed_per_room_from_lifecycle_decisions() -> None:
    import json

    from sglang_harden.testbed.decisions import quarantined_pages_by_room

    def line(**fields: object) -> str:
        return f"[2026-12-02 02:23:33] sglang_harden.decision {json.dumps(fields)}"

    log = "\n".join([
        line(guard="lifecycle", decision="quarantine", owner="room:7", pages=3),
        line(guard="lifecycle", decision="quarantine", owner="room:7", pages=2),
        line(guard="lifecycle", decision="release", owner="room:7", pages=5),  # not a quarantine
        line(guard="lifecycle", decision="quarantine", owner="room:-4", pages=1),
        line(guard="lifecycle", decision="quarantine", room=9, pages=2),  # prefill's: no owner
        line(guard="admission", decision="quarantine", owner="room:8", pages=1),  # another guard
    ])
    assert quarantined_pages_by_room(log) == {7: 5, -4: 1}


def test_forged_control_summary_and_violation() -> None:
    from collections import Counter

    refused = soak_judging.forged_summary(Counter({"PUT /pd_rejections 401": 3, "GET /route 401": 3}))
    assert (refused["sent"], refused["refused_401"], refused["accepted"]) == (6, 6, 0)
    assert _report(forged_control=refused).violations() == []
    leaked = soak_judging.forged_summary(Counter({"PUT /pd_rejections 401": 3, "GET /route 200": 2,
                                                  "GET /sglang_harden/aborts -1": 1}))
    assert (leaked["sent"], leaked["refused_401"], leaked["accepted"]) == (6, 3, 2)
    assert "accepted 2 forged" in _report(forged_control=leaked).violations()[0]


def _lines(path: Path, *events: dict[str, object]) -> None:
    import json

    with path.open("a") as out:
        for event in events:
            out.write(json.dumps(event) + "\n")


def test_late_write_lands_when_another_request_decodes_over_its_pages(tmp_path: Path) -> None:
    lander = soak_load.LateWriteLander(tmp_path)
    trigger = tmp_path / soak_spec.LATE_TRIGGER
    late = f"{soak_spec.LATE_RID_PREFIX}0"
    _lines(tmp_path / "latewrite-1.jsonl", {"event": "room_learnt", "rid": late, "room": 5, "t": 9.0},
           {"event": "kv_send", "room": 5, "t": 10.0, "dst_pages": [7, 8]},
           {"event": "engine_timeout", "room": 5, "t": 11.0})
    _lines(tmp_path / "kvtrace-2.jsonl", {"event": "admitted", "rid": late, "t": 9.5},
           {"event": "first_decode", "rid": "early", "t": 10.5, "pages": [7]},  # before the failure: its own
           {"event": "first_decode", "rid": late, "t": 12.0, "pages": [8]},  # the late request itself
           {"event": "first_decode", "rid": "elsewhere", "t": 12.5, "pages": [9]})
    # the same page ids on another decode node are other pages
    _lines(tmp_path / "kvtrace-3.jsonl", {"event": "first_decode", "rid": "other-node", "t": 12.6, "pages": [8]})
    lander.step()
    assert not trigger.exists() and lander.fired == {}
    _lines(tmp_path / "kvtrace-2.jsonl", {"event": "first_decode", "rid": "victim", "t": 13.0, "pages": [8, 9]})
    (tmp_path / "kvtrace-2.jsonl").open("a").write('{"event": "first_dec')  # a line still being written
    lander.step()
    assert trigger.exists() and lander.triggered == {5: "victim"}
    assert lander.fired == {}  # made to land, not landed yet
    lander.step()
    assert trigger.exists()  # kept until the write has landed
    _lines(tmp_path / "latewrite-1.jsonl", {"event": "late_write", "room": 5, "t": 13.1, "status": 0})
    lander.step()
    assert not trigger.exists() and lander.fired == {5: "victim"}
    assert lander.counts() == {"late_writes_attempted": 1, "late_writes_landed": 1, "late_writes_failed": 0}


def test_a_late_write_whose_replay_failed_did_not_land_on_its_victim(tmp_path: Path) -> None:
    """The trigger goes (the write is over) but the room is no landing: its engine call reported failure."""
    lander = soak_load.LateWriteLander(tmp_path)
    late = f"{soak_spec.LATE_RID_PREFIX}0"
    _lines(tmp_path / "latewrite-1.jsonl", {"event": "room_learnt", "rid": late, "room": 5, "t": 9.0},
           {"event": "kv_send", "room": 5, "t": 10.0, "dst_pages": [7, 8]},
           {"event": "engine_timeout", "room": 5, "t": 11.0})
    _lines(tmp_path / "kvtrace-2.jsonl", {"event": "admitted", "rid": late, "t": 9.5},
           {"event": "first_decode", "rid": "victim", "t": 13.0, "pages": [8]})
    lander.step()
    assert lander.triggered == {5: "victim"}
    _lines(tmp_path / "latewrite-1.jsonl", {"event": "late_write", "room": 5, "t": 13.1, "status": -1})
    lander.step()
    assert not (tmp_path / soak_spec.LATE_TRIGGER).exists()
    assert lander.fired == {}
    assert lander.counts() == {"late_writes_attempted": 1, "late_writes_landed": 0, "late_writes_failed": 1}


def test_clients_go_on_past_the_duration_until_enough_are_served_within_the_cap() -> None:
    load = soak_spec.SoakLoad(duration_s=10.0, min_served=2, max_duration_s=30.0)
    run = soak_load.LoadRun(TARGET, load, TOPO, None)
    now = soak_load.time.monotonic()
    run.stop_at = now + 5.0  # inside the duration
    assert run._clients_go_on()
    run.stop_at = now - 1.0  # past the duration, under the cap, none served
    assert run._clients_go_on()
    run.outcomes += [_outcome("normal", 200), _outcome("normal", 503)]
    assert run._clients_go_on()  # one served in full is not two
    run.outcomes.append(_outcome("normal", 200))
    assert not run._clients_go_on()
    run.outcomes.clear()
    run.stop_at = now - 21.0  # past the cap (started 31 s ago): stop even with none served
    assert not run._clients_go_on()
    plain = soak_load.LoadRun(TARGET, soak_spec.SoakLoad(duration_s=10.0), TOPO, None)
    plain.stop_at = now - 1.0  # no minimum: the duration alone
    assert not plain._clients_go_on()


def test_failure_story_names_failed_requests_and_non_routine_decisions(tmp_path: Path) -> None:
    from sglang_harden.events import LOG_TAG

    def line(**fields: object) -> str:
        return f"[x] {LOG_TAG} " + json.dumps({"ts": 1.0, **fields})

    (tmp_path / "decode0-0.5.23.log").write_text("\n".join([
        line(guard="checksum", decision="abort", rid="r-1", reason="KV digest could not be verified (timed out)"),
        line(guard="checksum", decision="allow", rid="r-2", reason=""),
        line(guard="abort_notify", decision="abort", rid="r-3", reason="prefill aborted"),
        "a line that is no decision",
    ]))
    unverified = soak_spec.Outcome("normal", "r-1", 500, 1.0, error="KV digest could not be verified")
    failed = soak_judging.summarize([unverified], [], 1.0, LOAD, 1600, 16)
    story = soak_report.failure_story(_report(summary=failed, log_dir=str(tmp_path)))
    assert story[0].startswith("failed: normal rid=r-1 status=500") and "could not be verified" in story[0]
    assert len(story) == 2 and "decode0-0.5.23 checksum:abort rid=r-1 KV digest could not be verified" in story[1]
