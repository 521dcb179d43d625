"""The incident on the production-shaped testbed profile ``paged16``: 16-token pages, the radix prefix cache on,
chunked prefill (64-token chunks, so tenant A's 200-token prompt takes four), and each pin's own default for early
send of the cached prefix (``sglang_harden.testbed.profiles``). Per pin and transfer backend: 0.5.19/Mooncake,
0.5.23/Mooncake, 0.5.23/NIXL.

Rounds: a warm-up, then tenant A seeds (1, 2), each round A then the oversized B (the incident setup of
``sglang_harden.testbed.incident``: prefill limit 250 < B's 300 tokens <= decode's 394), and A's prompt once more.

- the profile is in force: page size 16 in both servers' arguments, chunk 64 and the radix cache on prefill,
  full 64-token chunks in prefill's log, and radix hits when A's prompt is sent again right after A (the small
  prefill pool holds one A at a time) — with the same answer as the first send;
- vanilla: leak pins serve B with HTTP 200 over more than half of A's decode rows (the kv tracer); 0.5.21+ pins
  refuse B at prefill while decode never answers 200;
- hardened (capacity gate in ``log`` mode: the pools are deliberately too small; checksum in ``log`` mode so that
  the page-table fault below is judged by the page tags, which check only requests nothing aborted before them;
  every other guard in its default mode): every B is refused with 400 by
  prefill and decode and decode never runs a forward for it; A's answers are exactly vanilla's; both pools are
  full at quiesce and decode's page ledger (fed by the paged allocator's free hook) tracks no page and
  quarantines none;
- a transfer that leaves out one reserved page and reports success (test-only ``kvfault`` shim): vanilla serves
  it, the hardened canary (``enforce``, its default) aborts it;
- one bit of one received KV row flipped on decode before the commit (``kvfault`` ``flip``): vanilla serves it;
  the hardened per-transfer digest (``log`` mode on this pair, see above) finds exactly that request's KV
  differs from what prefill sent, and no clean request's (the digest over 16-token pages, chunked sends and
  radix hits sent early);
- a prompt prefill's front door (tokenizer validation) refuses while decode holds a reservation for it: vanilla
  decode hears nothing and waits out its timeout; hardened decode is told and answers 400 within the bound;
- a room decode gives up on by its waiting timeout while prefill never got the request (no sender, no write ever
  started; decode's half only, holding most of decode's pool): the next request needs those pages and must not
  wait. Vanilla answers it at once on every pin; hardened too (issue 40 (b): on 0.5.19 the lifecycle guard switches
  SGLang's deferred release on, whose timeout's abort notice never arms SGLang's ack count, so the pages were held
  for its 30 s timeout; the guard's own drain evidence now ends the hold, a counted lifecycle release);
- last (it leaves the pool inconsistent): SGLang's own page table points one prompt page of a request at a page in
  the allocator's free list (``kvfault`` ``table``): vanilla decodes over rows another request left there (the
  KV tracer), the hardened page-tag check aborts it at the commit.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sglang_harden.testbed import alert_rules
from sglang_harden.testbed.client import PairResult, generate, greedy_body
from sglang_harden.testbed.envs import load_pins
from sglang_harden.testbed.incident import (
    IncidentSetup,
    RoundResult,
    assert_table_fault_read_by_vanilla,
    front_door_round,
    run_round,
    start_incident_pair,
    table_fault_round,
    tenant_a_prompt,
)
from sglang_harden.testbed.profiles import get_profile
from sglang_harden.testbed.soak_judging import decision_delta

pytestmark = pytest.mark.e2e

PROFILE = get_profile("paged16")
SETUP = IncidentSetup(waiting_timeout_s=20, a_seeds=(1, 2))  # two contents of A (the incident module repeats them)
HARDEN_ENV = {"SGLANG_HARDEN_CAPACITY": "log", "SGLANG_HARDEN_CHECKSUM": "log"}
# The test-only kvfault shim: a KV send of exactly 3 pages leaves out its last page and still reports success.
# Only the 40-token request below makes such a send here (A's chunks are 4 pages, its final pieces 1, a radix
# hit's early send 12), so decode's third reserved page keeps what it held: the incident's stale page.
UNWRITTEN_PAGES = 3
UNWRITTEN_LEN = 40
# ... and, last of all (it leaves the pool inconsistent), SGLang's own page table is made to point one prompt page
# of the request in room TABLE_ROOM at a page in the allocator's free list (``table`` fault, decode side).
TABLE_ROOM = 991_000_001
# ... and one bit of one received KV row of the request in room FLIP_ROOM is flipped before decode commits it.
FLIP_ROOM = 991_000_002
# A request only decode gets (prefill never hears of it: no sender, no write ever started), holding most of decode's
# pool (400 tokens, 25 pages) until its waiting timeout; the next request (13 pages) fits only once those are back.
ORPHAN_ROOM, ORPHAN_LEN, AFTER_ORPHAN_LEN = 991_000_003, 240, 200
# SGLang's deferred release holds a room it is not told drained for 30 s; a request that waited for it is far above
NEXT_REQUEST_BOUND_S = 15.0
# pins whose waiting timeout sends decode's abort notice without arming SGLang's own ack count (0.5.19, 0.5.20)
UNARMED_TIMEOUT_NOTICE_PINS = ("0.5.19", "0.5.20")
FAULT_ENV = {"SGLANG_HARDEN_TESTBED_KV_FAULT": f"unwritten:{UNWRITTEN_PAGES},table:{TABLE_ROOM},flip:{FLIP_ROOM}"}
TOO_LONG = "exceeds the maximum allowed length"
FRONT_DOOR_BOUND_S = 5.0  # docs/guards.md: decode answers a refusal at prefill's front door within 5 s
RECIPES = load_pins()
CASES = [f"{pin}/{backend}" for pin in ("0.5.19", "0.5.23") if pin in RECIPES
         for backend in ("mooncake", "nixl") if backend in RECIPES[pin].transfer_backends]


def _say(msg: str) -> None:
    print(f"[paged-profile-e2e] {msg}", file=sys.stderr, flush=True)


@pytest.fixture(scope="module", params=CASES)
def pin(request: pytest.FixtureRequest, require_pin: Callable[[str], None]) -> str:
    """``<pin>/<transfer backend>``; module-scoped, so one case's two runs serve all its tests."""
    require_pin(str(request.param))
    return str(request.param)


def _run(pin: str, backend: str, hardened: bool, log_dir: Path) -> dict[str, Any]:
    """Warm-up + the A/B rounds on a fresh pair (stopped again). Vanilla stops after the first round decode did
    not serve (0.5.21+: decode sits out its waiting timeout each time; once is enough)."""
    pair = start_incident_pair(pin, hardened=hardened, setup=SETUP, log_dir=log_dir, transfer_backend=backend,
                               extra_env=FAULT_ENV, harden_env=HARDEN_ENV, profile=PROFILE, progress=True,
                               flags=["--enable-metrics"])
    rounds: list[RoundResult] = []
    repeats: list[PairResult] = []
    try:
        first_scrapes = {role: alert_rules.scrape(server.url) for role, server in
                         (("prefill", pair.prefill), ("decode", pair.decode))}
        args = {role: _serving_args(server.server_info()) for role, server in
                (("prefill", pair.prefill), ("decode", pair.decode))}
        for index, seed in enumerate((SETUP.warmup_seed, *SETUP.a_seeds)):
            rounds.append(run_round(pair, index, seed, SETUP))
            # the prefill pool holds one A at a time: A's prompt again, at once, is a radix hit
            repeats.append(pair.generate(greedy_body(tenant_a_prompt(seed, SETUP.a_len), SETUP.new_tokens,
                                                     rid=f"A{index}-again")))
            if not hardened and not rounds[-1].b.decode.ok:
                break
        before_flip = pair.decode.harden_decisions() if hardened else {}
        flip = pair.generate(greedy_body(tenant_a_prompt(31, 120), 8, rid="flipped-bit"), room=FLIP_ROOM,
                             timeout=SETUP.waiting_timeout_s + 120)
        after_flip = pair.decode.harden_decisions() if hardened else {}
        unwritten = pair.generate(greedy_body(tenant_a_prompt(9, UNWRITTEN_LEN), 8, rid="unwritten-page"),
                                  timeout=SETUP.waiting_timeout_s + 120)
        decisions = pair.decode.harden_decisions() if hardened else {}
        door = front_door_round(pair, SETUP, tag=f"{'hardened' if hardened else 'vanilla'}-")
        orphan = _orphan_round(pair, hardened) if _runs_orphan_round(pin, backend, hardened) else None
        quiesce = pair.wait_quiesced(timeout=SETUP.quiesce_timeout_s)
        table = table_fault_round(pair, TABLE_ROOM)
        table_decisions = pair.decode.harden_decisions() if hardened else {}
        scrapes = {role: (first_scrapes[role], alert_rules.scrape(server.url)) for role, server in
                   (("prefill", pair.prefill), ("decode", pair.decode))}
    finally:
        pair.stop()
    return {"args": args, "rounds": rounds, "repeats": repeats, "unwritten": unwritten, "decisions": decisions,
            "flip": flip, "before_flip": before_flip, "flip_decisions": decision_delta(before_flip, after_flip),
            "front_door": door, "orphan": orphan, "scrapes": scrapes,
            "quiesce": quiesce, "prefill_log": pair.prefill.log_text(), **table,
            "table_decisions": decision_delta(decisions, table_decisions)}


def _runs_orphan_round(pin: str, backend: str, hardened: bool) -> bool:
    """Hardened, Mooncake, where SGLang's timeout path does not arm its own ack count: where the hold was the guard's
    (vanilla answered the next request in 0.8 s on 0.5.19; 0.5.21+ count the ack themselves; CI time)."""
    return hardened and backend == "mooncake" and pin.split("/")[0] in UNARMED_TIMEOUT_NOTICE_PINS


def _orphan_round(pair: Any, hardened: bool) -> dict[str, Any]:
    """Decode's half of a request prefill never gets: decode gives up on it at its waiting timeout. Then a request
    that needs the pages it held, timed from that answer."""
    assert pair.prefill.bootstrap_port is not None
    before = pair.decode.harden_decisions() if hardened else {}
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": pair.prefill.bootstrap_port, "bootstrap_room": ORPHAN_ROOM}
    body = {**greedy_body(tenant_a_prompt(41, ORPHAN_LEN), 4, rid="orphan"), **boot}
    given_up = generate(pair.decode.url, body, timeout=SETUP.waiting_timeout_s + 120)
    started = time.monotonic()
    after = pair.generate(greedy_body(tenant_a_prompt(42, AFTER_ORPHAN_LEN), 4, rid="after-orphan"), timeout=120)
    elapsed = time.monotonic() - started
    decisions = decision_delta(before, pair.decode.harden_decisions()) if hardened else {}
    timed_out = f"Deferred KV release for room {ORPHAN_ROOM} timed out"
    held = [line for line in pair.decode.log_text().splitlines() if timed_out in line]
    _say(f"orphan round ({'hardened' if hardened else 'vanilla'}): decode gave up after {given_up.elapsed_s:.1f} s "
         f"({given_up.status}); the next request took {elapsed:.2f} s ({after.decode.status}); decisions {decisions}")
    return {"given_up": given_up.summary(), "next": after.decode.summary(), "next_elapsed_s": round(elapsed, 2),
            "decisions": decisions, "released_at_timeout": held}


def _serving_args(info: dict[str, Any]) -> dict[str, Any]:
    return {key: info.get(key) for key in ("page_size", "chunked_prefill_size", "disable_radix_cache")}


@pytest.fixture(scope="module")
def runs(pin: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    version, backend = pin.split("/")
    out = {}
    for variant in ("vanilla", "hardened"):
        log_dir: Path = tmp_path_factory.mktemp(f"paged16-{version}-{backend}-{variant}")
        _say(f"{pin} {variant}: {PROFILE.describe()} (logs {log_dir})")
        out[variant] = _run(version, backend, variant == "hardened", log_dir)
    return out


def _cached_tokens(log: str) -> list[int]:
    return [int(n) for n in re.findall(r"#cached-token: (\d+)", log)]


def _new_tokens(log: str) -> list[int]:
    return [int(n) for n in re.findall(r"#new-token: (\d+)", log)]


def _brief(rounds: list[RoundResult]) -> list[dict[str, Any]]:
    return [{"round": r.index, "a": r.a.decode.status, "b_prefill": r.b.prefill.summary(),
             "b_decode": r.b.decode.summary(), "a_rows_read_by_b": r.a_rows_read_by_b} for r in rounds]


def test_profile_in_force(runs: dict[str, dict[str, Any]]) -> None:
    for variant, run in runs.items():
        assert run["args"]["prefill"] == {"page_size": 16, "chunked_prefill_size": 64,
                                          "disable_radix_cache": False}, run["args"]
        assert run["args"]["decode"]["page_size"] == 16, run["args"]
        assert SETUP.a_len > 64 and 64 in _new_tokens(run["prefill_log"]), f"{variant}: no full 64-token chunk"
        cached = _cached_tokens(run["prefill_log"])
        assert max(cached, default=0) >= 16, f"{variant}: no radix hit on A's prompt sent again ({cached})"


def test_radix_hit_answers_like_the_first_send(runs: dict[str, dict[str, Any]]) -> None:
    for variant, run in runs.items():
        for first, again in zip(run["rounds"], run["repeats"], strict=True):
            assert first.a.decode.status == again.decode.status == 200, (variant, again.decode.summary())
            assert first.a.decode.output_ids == again.decode.output_ids, (variant, first.index)


def test_vanilla_behaviour_on_paged_kv(pin: str, runs: dict[str, dict[str, Any]]) -> None:
    rounds = runs["vanilla"]["rounds"]
    if RECIPES[pin.split("/")[0]].incident == "leak":
        assert len(rounds) == 1 + len(SETUP.a_seeds), _brief(rounds)
        for r in rounds:
            assert r.b.decode.status == 200, _brief(rounds)
            assert r.a_rows_read_by_b > SETUP.a_len // 2, _brief(rounds)
    else:
        first = rounds[0]
        assert first.b.prefill.status == 400 and TOO_LONG in first.b.prefill.error_message(), _brief(rounds)
        assert first.b.decode.status != 200, _brief(rounds)


@pytest.mark.proves("plugin", "admission", control="test_vanilla_behaviour_on_paged_kv")
def test_hardened_refuses_b_at_both_doors(runs: dict[str, dict[str, Any]]) -> None:
    rounds = runs["hardened"]["rounds"]
    assert len(rounds) == 1 + len(SETUP.a_seeds), _brief(rounds)
    for r in rounds:
        assert r.b.prefill.status == 400 and TOO_LONG in r.b.prefill.error_message(), _brief(rounds)
        assert r.b.decode.status == 400 and TOO_LONG in r.b.decode.error_message(), _brief(rounds)
        assert r.b_rows is None and r.a_rows_read_by_b == 0, _brief(rounds)


def test_hardened_answers_a_like_vanilla(runs: dict[str, dict[str, Any]]) -> None:
    vanilla, hardened = runs["vanilla"]["rounds"], runs["hardened"]["rounds"]
    for v, h in zip(vanilla, hardened, strict=False):
        assert v.a.decode.status == h.a.decode.status == 200, (_brief(vanilla), _brief(hardened))
        assert v.a.decode.output_ids == h.a.decode.output_ids, (v.index, v.a.decode.summary(), h.a.decode.summary())


@pytest.mark.proves("plugin", "canary", control="self")
def test_unwritten_page_served_by_vanilla_refused_by_the_canary(runs: dict[str, dict[str, Any]]) -> None:
    """A transfer that skipped one reserved page and reported success: vanilla decode generates over the page's
    old content; hardened decode (the canary in its default mode, ``enforce``) aborts before the
    first decode step, and it is the canary's verdict (it runs before the digest at commit)."""
    vanilla, hardened = runs["vanilla"]["unwritten"].decode, runs["hardened"]["unwritten"].decode
    assert vanilla.status == 200 and vanilla.output_ids, vanilla.summary()
    assert hardened.status >= 400 and not hardened.output_ids, hardened.summary()
    assert "reserved KV pages were never written by its transfer" in hardened.error_message(), hardened.summary()
    assert runs["hardened"]["decisions"].get("canary:abort", 0) == 1, runs["hardened"]["decisions"]


def test_hardened_pools_full_and_ledger_clean(runs: dict[str, dict[str, Any]]) -> None:
    quiesce = runs["hardened"]["quiesce"]
    assert all(pool.get("full") for pool in quiesce.values()), quiesce
    ledger = quiesce["decode"].get("harden_lifecycle") or {}
    assert ledger.get("page_size") == 16, quiesce
    assert ledger.get("pages_not_free_in_ledger") == 0 and ledger.get("quarantined_pages") == 0, quiesce


@pytest.mark.proves("plugin", "page_tags", control="self")
def test_page_table_pointing_at_a_free_page_read_by_vanilla_refused_by_page_tags(
    runs: dict[str, dict[str, Any]],
) -> None:
    """SGLang's own page table made inconsistent (``table`` fault: one prompt page of the request points at a page
    in the allocator's free list, after the transfer wrote the right one). Vanilla decodes over it and the KV
    tracer sees rows another request left there; hardened decode's page-tag check at the commit finds a page
    the request does not own in its ledger and aborts before the first decode step. (The canary is about the pages
    the transfer wrote, which are intact; the digest, which reads the page table too, would catch it first in
    ``enforce`` and is in ``log`` mode on this pair.)"""
    vanilla, hardened = runs["vanilla"], runs["hardened"]
    assert_table_fault_read_by_vanilla(vanilla, hardened)
    h = hardened["table"].decode
    assert h.status == 500 and not h.output_ids, h.summary()
    assert "page ownership check failed" in h.error_message(), h.summary()
    assert hardened["table_decisions"].get("page_tags:abort") == 1, hardened["table_decisions"]
    assert hardened["table_first_decode"] is None, hardened["table_first_decode"]


@pytest.mark.proves("plugin", "checksum", control="self")
def test_flipped_bit_served_by_vanilla_found_by_the_digest(runs: dict[str, dict[str, Any]]) -> None:
    """One bit of one received KV row flipped before the commit: vanilla decodes over it; the hardened digest
    (``log`` mode here) tells that request's KV from what prefill sent, and found no clean request's different."""
    vanilla, hardened = runs["vanilla"]["flip"].decode, runs["hardened"]["flip"].decode
    assert vanilla.status == 200 and vanilla.output_ids, vanilla.summary()
    assert hardened.status == 200, hardened.summary()  # log mode: counted, not applied
    flip = runs["hardened"]["flip_decisions"]
    assert flip.get("checksum:abort_logged") == 1, flip
    before = runs["hardened"]["before_flip"]
    assert before.get("checksum:abort_logged", 0) == 0, before
    assert before.get("checksum:allow", 0) >= len(SETUP.a_seeds), before


def test_vanilla_decode_holds_a_front_door_refusal(runs: dict[str, dict[str, Any]]) -> None:
    """The control of the patched series' abort notice (test_patched_incident.py): prefill's tokenizer refuses a
    prompt longer than the context, and vanilla decode, holding a reservation for the room, waits out its timeout."""
    vanilla = runs["vanilla"]["front_door"]
    assert vanilla["prefill"]["status"] == 400 and "context length" in (vanilla["prefill_error"] or ""), vanilla
    assert vanilla["decode_status"] != 200 and not vanilla["decode_generated"], vanilla
    assert vanilla["decode_elapsed_s"] >= 0.8 * SETUP.waiting_timeout_s, vanilla


@pytest.mark.proves("plugin", "abort_notify", control="self")
def test_front_door_refusal_held_by_vanilla_told_to_hardened(runs: dict[str, dict[str, Any]]) -> None:
    """Prefill's tokenizer refuses a prompt longer than the context while decode holds a reservation for the
    same room: vanilla decode hears nothing and waits out its timeout; hardened decode answers prefill's 400
    within the bound and never generates."""
    vanilla, hardened = runs["vanilla"]["front_door"], runs["hardened"]["front_door"]
    for door in (vanilla, hardened):
        assert door["prefill"]["status"] == 400 and "context length" in (door["prefill_error"] or ""), door
    assert vanilla["decode_status"] != 200 and not vanilla["decode_generated"], vanilla
    assert vanilla["decode_elapsed_s"] >= 0.8 * SETUP.waiting_timeout_s, vanilla
    assert hardened["decode_status"] == 400 and "context length" in (hardened["decode_error"] or ""), hardened
    assert hardened["decode_elapsed_s"] < FRONT_DOOR_BOUND_S and not hardened["decode_generated"], hardened


def test_room_decode_gave_up_on_before_any_write_is_released_at_once(pin: str, runs: dict[str, dict[str, Any]]) -> None:
    """Issue 40 (b), a liveness check of the guard itself (not a proof of it: vanilla never held these pages).
    Decode gives up on a room at its waiting timeout; prefill never had the request (no sender, no write ever
    started). The next request, which needs the pages decode held for it, is answered without waiting, as vanilla
    answers it. On 0.5.19 the hardened hold used to last SGLang's 30 s deferred-release timeout (the guard switches
    that release on; the timeout's abort notice never arms SGLang's own ack count there): now the guard's own drain
    evidence ends it, counted as a lifecycle release, and SGLang's timeout never fires. Without that release the
    hardened next request waited 33.6 s on 0.5.19 (vanilla 0.8 s)."""
    orphan = runs["hardened"]["orphan"]
    if orphan is None:
        pytest.skip(f"{pin}: the orphan round runs on the Mooncake cases of {', '.join(UNARMED_TIMEOUT_NOTICE_PINS)}")
    assert orphan["given_up"]["status"] == 500 and "timed out" in (orphan["given_up"]["error"] or ""), orphan
    assert orphan["given_up"]["elapsed_s"] >= 0.8 * SETUP.waiting_timeout_s, orphan
    assert orphan["next"]["status"] == 200, orphan
    assert orphan["next_elapsed_s"] < NEXT_REQUEST_BOUND_S, orphan
    assert orphan["released_at_timeout"] == [], orphan
    assert orphan["decisions"].get("lifecycle:release", 0) >= 1, orphan


def test_alert_rules_fire_on_the_pairs_metrics(runs: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    """The fleet's alert rules (deploy/prometheus/) over both pairs' real ``/metrics`` (scraped right after each
    start and after its last request): the vanilla pair fires SGLangHardenMissing on both nodes and nothing else;
    the hardened one fires SGLangHardenIntegrityAbort on decode for the canary's and the page tags' aborts and the
    digest's logged one, and SGLangHardenNotEnforcing a week on (the checksum guard in log mode makes the nodes
    ``mixed``), and neither SGLangHardenMissing nor SGLangHardenGuardsNotArmed."""
    if alert_rules.promtool() is None:
        pytest.skip("promtool not installed (scripts/fetch_promtool.sh fetches it)")
    pytest.importorskip("yaml")  # the rules' annotations
    (tmp_path / "vanilla").mkdir()
    (tmp_path / "hardened").mkdir()
    vanilla = alert_rules.judge_nodes(runs["vanilla"]["scrapes"], tmp_path / "vanilla")
    assert vanilla.expected["SGLangHardenMissing"] == [{"instance": instance, "severity": "critical"}
                                                       for instance in ("decode", "prefill")]
    assert not any(labels for alert, labels in vanilla.expected.items() if alert != "SGLangHardenMissing")
    assert vanilla.ok, vanilla.result.stdout + vanilla.result.stderr
    hardened = alert_rules.judge_nodes(runs["hardened"]["scrapes"], tmp_path / "hardened")
    aborts = {(labels["instance"], labels["guard"], labels["decision"])
              for labels in hardened.expected["SGLangHardenIntegrityAbort"]}
    assert {("decode", "canary", "abort"), ("decode", "page_tags", "abort"),
            ("decode", "checksum", "abort_logged")} <= aborts, aborts
    lenient = hardened.expected["SGLangHardenNotEnforcing"]
    assert {labels["instance"] for labels in lenient} == {"decode", "prefill"}, lenient
    assert {labels["mode"] for labels in lenient} == {"mixed"}, lenient
    assert hardened.expected["SGLangHardenMissing"] == hardened.expected["SGLangHardenGuardsNotArmed"] == []
    assert hardened.ok, hardened.result.stdout + hardened.result.stderr
