"""Guards I on real SGLang PD pairs (tiny model, Mooncake TCP, loopback): hardened vs vanilla, per pin.

The incident setup of ``sglang_harden.testbed.incident`` (prefill limit 250 < B's 300 tokens <= decode's 394).
The vanilla side of the same scenario is asserted in ``test_paged_profile_e2e.py`` on 16-token pages (and on page 1
in ``test_incident.py``, profile ``minimal``): <= 0.5.20: B gets 200 and reads A's KV; 0.5.21+: prefill 400, decode
holds its reservation until the waiting timeout. Here:

- hardened (``sglang_harden.launch_server``; capacity gate in ``log`` mode because the scenario's pools are
  deliberately too small): B gets HTTP 400 with the original "too long" message from prefill, from decode and
  through sglang-router, within 5 s; decode never generates for B; both pools are full again at quiesce;
  normal requests answer exactly as on vanilla.
- coverage (``--allow-auto-truncate`` on prefill, so nothing is rejected and prefill silently sends KV for
  250 of B's 300 tokens): vanilla decode answers 200 over 50 rows it never received; hardened aborts B.
- activation: the guards are armed in the scheduler subprocesses (their own start-up log line, from a pid other
  than the launcher's), through the launcher on every pin (SGLang's plugin entry point with a plain
  ``sglang.launch_server``: ``test_importhook_coexist_e2e.py``).
- operator tools (0.5.19): ``probe`` passes on the hardened pair (``--enable-metrics``), ``audit`` sees its guards,
  prefill's ``/metrics`` counts the admission rejections.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import sglang_harden
from sglang_harden.compat.backends import BACKEND_MODULES
from sglang_harden.compat.backends.common import DROPPING_BRANCH
from sglang_harden.compat.pins import SUPPORTED_PINS
from sglang_harden.testbed import alert_rules
from sglang_harden.testbed.client import PairResult, generate, greedy_body, http_json, pd_generate
from sglang_harden.testbed.decisions import notify_latencies, quarantined_pages_by_room
from sglang_harden.testbed.envs import load_pins, plugin_pins
from sglang_harden.testbed.incident import (
    COVERAGE_ALONE,
    KVTRACE_ENV,
    IncidentSetup,
    start_incident_pair,
    tenant_a_prompt,
    tenant_b_prompt,
)
from sglang_harden.testbed.jsonl import read_folder
from sglang_harden.testbed.latewrite import LATE_WRITE_ENV
from sglang_harden.testbed.latewrite_trace import late_writes, write_counts, write_replayed
from sglang_harden.testbed.patched_bootstrap import registration
from sglang_harden.testbed.pd_topology import PDPair, stop_together
from sglang_harden.testbed.server import Server
from sglang_harden.testbed.soak_requests import ROUTE_TABLE_QUERY
from sglang_harden.testbed.tools_cli import pair_args, probe_results, run_tool
from sglang_harden.tools._source import SourceTree
from sglang_harden.tools._wheels import release_tree
from sglang_harden.tools.audit import parse_guard_counters
from sglang_harden.tools.matrix import plugin_guards

pytestmark = pytest.mark.e2e

PINS = plugin_pins()  # the plugin's guards: not on a patch-only release
SETUP = IncidentSetup(waiting_timeout_s=60)
TOO_LONG = "exceeds the maximum allowed length"
PROMPT_BOUND_S = 5.0
# docs/guards.md: decode is told of a prefill refusal within ~0.2-0.5 s. Measured between the two servers' decision
# lines (prefill refused the room -> decode aborted it on the notice), not by the client, whose wait includes the host.
NOTIFY_BOUND_S = 1.0
# A refusal that comes after prefill's forward and the transfer (short send, retired final send): on a loaded
# CI host the forward alone took 7.5 s; still far below the 60 s waiting timeout a decode that was not told
# would sit out.
AFTER_FORWARD_BOUND_S = 30.0
HARDEN_ENV = {"SGLANG_HARDEN_CAPACITY": "log"}
NORMAL_SEEDS = (11, 12, 13)
# a request that takes most of decode's pool for several seconds (B cannot be preallocated meanwhile)
HOLDER_PROMPT_LEN = 200
HOLDER_HEAD_START_S = 1.5
# test-only shim: decode's scheduler loop sleeps STALL_S once each time the trigger file appears
STALL_ENV = "SGLANG_HARDEN_TESTBED_STALL_DECODE"
STALL_TRIGGER = "stall-decode"
STALL_S = 10.0
PREFILL_STALL_ENV = "SGLANG_HARDEN_TESTBED_STALL_PREFILL"
PREFILL_STALL_TRIGGER = "stall-prefill"
# test-only latewrite shim on the hardened pair: the engine call for this room gives up after LATE_TIMEOUT_S (its
# decode session is then marked failed) while its bytes land LATE_DELAY_S after the send started
LATE_ROOM = 7_600_000_001
LATE_TIMEOUT_S = 3.0
LATE_DELAY_S = 8.0
LATE_LIFETIME_S = 12  # the sender's bound on that write's lifetime (covers the delay)
# pins whose decode frees a room prefill failed at once (our quarantine then holds A's pages); later pins hold a
# failed room's pages themselves until prefill acks the drain (SGLang's deferred release)
FREES_A_FAILED_ROOM_AT_ONCE = ("0.5.19",)
# test-only shim on the hardened pair: the Mooncake worker's next Success sync to decode (pins that sync per
# endpoint) sleeps SUCCESS_SYNC_DELAY_S each time the trigger file appears
SUCCESS_SYNC_ENV = "SGLANG_HARDEN_TESTBED_DELAY_SUCCESS_SYNC"
SUCCESS_SYNC_TRIGGER = "delay-success-sync"
SUCCESS_SYNC_DELAY_S = 5.0
TOOLS_PIN = "0.5.19"  # where the operator tools' e2e cases run (probe here, on the hardened pair)
FIRST_SCRAPES: dict[str, dict[str, str]] = {}  # pin -> {role: the hardened pair's /metrics right after its start}
RETIRE_PREFIX = "retire-"  # rids the test-only abortsend hook aborts on prefill right before the final send


def _say(msg: str) -> None:
    print(f"[guards-e2e] {msg}", file=sys.stderr, flush=True)


PairFactory = Callable[[str], PDPair]


@pytest.fixture(scope="module", params=PINS)
def pin(request: pytest.FixtureRequest, require_pin: Callable[[str], None]) -> str:
    """Module-scoped, so pytest runs every test of one pin before starting the next pin's servers."""
    require_pin(request.param)
    return str(request.param)


@pytest.fixture(scope="module")
def pairs(pin: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PairFactory]:
    """``pairs(kind)`` -> a started pair of this pin; every pair is stopped when the pin's tests end.

    Kinds come in groups ("hardened"; "vanilla-truncate" + "hardened-truncate"); starting a pair of another
    group first stops the running group, so at most two pairs run at once on this 2-core machine."""
    started: dict[str, PDPair] = {}

    def get(kind: str) -> PDPair:
        if kind not in started:
            for other in [k for k in started if _group(k) != _group(kind)]:
                started.pop(other).stop()
            log_dir: Path = tmp_path_factory.mktemp(f"guards-{pin}-{kind}")
            _say(f"{pin}: starting {kind} pair (logs {log_dir})")
            started[kind] = _start(pin, kind, log_dir)
        return started[kind]

    try:
        yield get
    finally:
        stop_together([part for pair in started.values() for part in pair.parts()])


def _group(kind: str) -> str:
    return "truncate" if kind.endswith("truncate") else kind


def _start(pin: str, kind: str, log_dir: Path) -> PDPair:
    hardened = kind.startswith("hardened")
    truncate = kind.endswith("truncate")
    if truncate:
        return _start_truncating(pin, hardened, log_dir)
    shims = {STALL_ENV: f"{log_dir / STALL_TRIGGER}:{STALL_S}",
             PREFILL_STALL_ENV: f"{log_dir / PREFILL_STALL_TRIGGER}:{STALL_S}",
             SUCCESS_SYNC_ENV: f"{log_dir / SUCCESS_SYNC_TRIGGER}:{SUCCESS_SYNC_DELAY_S}",
             LATE_WRITE_ENV: f"{LATE_DELAY_S}:{LATE_ROOM}:timeout={LATE_TIMEOUT_S}",
             KVTRACE_ENV: str(log_dir / "kvtrace"),
             "SGLANG_HARDEN_TRANSFER_WRITE_LIFETIME_S": str(LATE_LIFETIME_S)} if hardened else {}
    pair = start_incident_pair(pin, hardened=hardened, setup=SETUP, log_dir=log_dir, router=True,
                               harden_env={**HARDEN_ENV, **shims}, progress=True,
                               flags=["--enable-metrics"] if hardened else [])
    if hardened:
        FIRST_SCRAPES[pin] = {node.role: alert_rules.scrape(node.url) for node in (pair.prefill, pair.decode)}
    return pair


def _start_truncating(pin: str, hardened: bool, log_dir: Path) -> PDPair:
    from sglang_harden.testbed.server import HARDENED_LAUNCHER, VANILLA_LAUNCHER

    env = {"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(SETUP.waiting_timeout_s),
           "SGLANG_HARDEN_TESTBED_ABORT_BEFORE_SEND": RETIRE_PREFIX}
    if hardened:
        env.update({"SGLANG_HARDEN_ACTIVATE": "1", **HARDEN_ENV, **COVERAGE_ALONE})
    pair = PDPair(
        pin,
        prefill_max_total_tokens=SETUP.prefill_max_total_tokens,
        decode_max_total_tokens=SETUP.decode_max_total_tokens,
        context_length=SETUP.context_length,
        num_reserved_decode_tokens=SETUP.num_reserved_decode_tokens,
        prefill_flags=["--allow-auto-truncate"],
        env=env,
        decode_env={"SGLANG_HARDEN_TESTBED_KVTRACE_DIR": str(log_dir / "kvtrace")},
        launcher_module=HARDENED_LAUNCHER if hardened else VANILLA_LAUNCHER,
        log_dir=log_dir,
        progress=True,
    )
    return pair.start()


def _wait_pool_full(server: Server, timeout: float = PROMPT_BOUND_S, wake: Server | None = None) -> dict[str, Any]:
    """The server's sglang_harden state once its pool is full, or the last state seen at ``timeout`` (callers
    assert on it: free == max_total_num_tokens). ``wake``: a server asked for its info before each poll (an idle
    scheduler runs a loop when something asks it)."""
    deadline = time.monotonic() + timeout
    while True:
        if wake is not None:
            wake.server_info()
        state = server.harden_state()
        free = state.get("available_tokens", 0) + state.get("evictable_tokens", 0)
        if state and free == state.get("max_total_num_tokens"):
            return state
        if time.monotonic() > deadline:
            return state
        time.sleep(0.2)


def _send_a_then_b(pair: PDPair, tag: str) -> Any:
    a = pair.generate(greedy_body(tenant_a_prompt(1, SETUP.a_len), SETUP.new_tokens, rid=f"{tag}-A"))
    assert a.prefill.ok and a.decode.ok, (a.prefill.summary(), a.decode.summary())
    return pair.generate(greedy_body(tenant_b_prompt(SETUP.b_len), SETUP.new_tokens, rid=f"{tag}-B"),
                         timeout=SETUP.waiting_timeout_s + 60)


def _decode_generated_for(pair: PDPair, rid: str) -> bool:
    trace = pair.log_dir / "kvtrace"
    from sglang_harden.testbed.incident import first_decode_event

    return first_decode_event(trace, rid) is not None


def _require_guard(pin: str, guard: str) -> None:
    """Skip where the plugin's adapter for ``pin`` has no hooks for ``guard`` (docs/support.md, README's matrix)."""
    if guard not in plugin_guards(pin):
        pytest.skip(f"{pin}: the plugin's {SUPPORTED_PINS[pin]} adapter has no {guard} hooks")


def _require_front_answers(pin: str) -> None:
    """Skip where the HTTP fronts do not answer refusals themselves: the 0.4.9 adapter's pins (docs/guards.md)."""
    if SUPPORTED_PINS[pin] == "sglang_v049":
        pytest.skip(f"{pin}: the HTTP fronts answer refusals themselves with the 0.5 adapter only (docs/guards.md)")


@pytest.mark.proves(
    "plugin", "admission",
    control="tests/e2e/test_paged_profile_e2e.py::test_vanilla_behaviour_on_paged_kv",
)
def test_oversized_prompt_rejected_at_both_doors_direct(pairs: PairFactory, pin: str) -> None:
    pair = pairs("hardened")
    b = _send_a_then_b(pair, "direct")
    for half in (b.prefill, b.decode):
        assert half.status == 400, half.summary()
        assert TOO_LONG in half.error_message(), half.error_message()
        assert half.output_ids is None
    assert b.decode.elapsed_s < PROMPT_BOUND_S, b.decode.summary()
    assert not _decode_generated_for(pair, "direct-B"), "decode ran a decode step for the rejected request"


@pytest.mark.proves(
    "plugin", "admission",
    control="tests/e2e/test_paged_profile_e2e.py::test_vanilla_behaviour_on_paged_kv",
)
def test_oversized_prompt_rejected_through_router(pairs: PairFactory, pin: str) -> None:
    pair = pairs("hardened")
    started = time.monotonic()
    result = pair.generate_via_router(greedy_body(tenant_b_prompt(SETUP.b_len), SETUP.new_tokens, rid="router-B"),
                                      timeout=SETUP.waiting_timeout_s + 60)
    elapsed = time.monotonic() - started
    assert result.status == 400, result.summary()
    assert TOO_LONG in result.error_message(), result.error_message()
    assert elapsed < PROMPT_BOUND_S, elapsed
    assert not _decode_generated_for(pair, "router-B")


@pytest.mark.proves(
    "plugin", "abort_notify",
    control="tests/e2e/test_incident.py::test_front_door_refusal_leaves_decode_holding",
)
def test_front_door_refusal_releases_decode_promptly(pairs: PairFactory, pin: str) -> None:
    """Prefill's tokenizer refuses the prompt (longer than the context) before its scheduler sees it; decode,
    holding a reservation for the same room, acts on prefill's notice within 1 s of the refusal (the servers' own
    decision lines), answers 400 with prefill's message within 5 s and frees it."""
    from sglang_harden.testbed.incident import front_door_round

    pair = pairs("hardened")
    door = front_door_round(pair, SETUP, tag="hardened-")
    assert door["prefill"]["status"] == 400, door
    assert door["decode_status"] == 400, door
    assert "context length" in (door["decode_error"] or ""), door
    assert door["decode_elapsed_s"] < PROMPT_BOUND_S, door
    told = notify_latencies([pair.prefill.log_text()], [pair.decode.log_text()])
    assert door["room"] in told, (door, told)
    assert told[door["room"]] <= NOTIFY_BOUND_S, (door, told)
    assert not door["decode_generated"], door
    state = _wait_pool_full(pair.decode)
    assert state["available_tokens"] + state["evictable_tokens"] == state["max_total_num_tokens"], state
    assert not state.get("lifecycle") or state["lifecycle"].get("quarantined_pages") == 0, state


def test_refusal_reaches_a_decode_whose_pool_is_busy(pairs: PairFactory, pin: str) -> None:
    """A holder request reaches decode first and takes most of its pool while it waits for its KV, so B waits in
    decode's preallocation queue with its handshake done. Up to 0.5.22 SGLang skips polling that queue while
    every entry there has finished its handshake, so a refusal marked on B's receiver is seen only when
    something else arrives or frees memory. Hardened decode must answer B 400 within the bound while the holder
    still waits; the holder's prefill half is sent only after B is answered, and then completes normally."""
    _require_front_answers(pin)
    pair = pairs("hardened")
    assert pair.prefill.bootstrap_port is not None
    room = 7_700_000_000 + int(time.time()) % 1_000_000
    boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": pair.prefill.bootstrap_port, "bootstrap_room": room}
    holder = {**greedy_body(tenant_a_prompt(7, HOLDER_PROMPT_LEN), SETUP.new_tokens, rid="busy-holder"), **boot}
    decode_half: dict[str, Any] = {}
    waiting = threading.Thread(target=lambda: decode_half.update(r=generate(pair.decode.url, holder, timeout=120)))
    waiting.start()
    time.sleep(HOLDER_HEAD_START_S)  # decode preallocates the holder's pages and waits for its KV
    b = pair.generate(greedy_body(tenant_b_prompt(SETUP.b_len), SETUP.new_tokens, rid="busy-B"),
                      timeout=SETUP.waiting_timeout_s + 60)
    holder_was_waiting = waiting.is_alive()
    prefill_half = generate(pair.prefill.url, holder, timeout=120)
    waiting.join()
    assert b.decode.elapsed_s < PROMPT_BOUND_S, b.decode.summary()
    assert b.decode.status == 400 and TOO_LONG in b.decode.error_message(), b.decode.summary()
    assert holder_was_waiting, decode_half
    assert prefill_half.ok and decode_half["r"].ok, (prefill_half.summary(), decode_half["r"].summary())


def test_refusal_answered_while_decode_scheduler_is_stalled(pairs: PairFactory, pin: str) -> None:
    """Decode's scheduler is stuck in one long loop (a saturated host: seconds per loop), so it neither takes B
    in nor answers it. Decode's HTTP front watches prefill's abort board itself and answers B with prefill's 400
    long before the scheduler wakes; the scheduler then frees B's pages on the same notice."""
    _require_front_answers(pin)
    pair = pairs("hardened")
    (pair.log_dir / STALL_TRIGGER).touch()
    time.sleep(0.5)  # the scheduler's loop takes the trigger and stalls
    b = pair.generate(greedy_body(tenant_b_prompt(SETUP.b_len), SETUP.new_tokens, rid="stalled-B"),
                      timeout=SETUP.waiting_timeout_s + 60)
    assert not (pair.log_dir / STALL_TRIGGER).exists(), "the stall never started"
    assert b.decode.status == 400 and TOO_LONG in b.decode.error_message(), b.decode.summary()
    assert b.decode.elapsed_s < STALL_S / 4, (
        f"B answered in {b.decode.elapsed_s:.1f} s: decode waited for its stalled scheduler")
    state = _wait_pool_full(pair.decode, timeout=STALL_S + PROMPT_BOUND_S)
    assert state["available_tokens"] + state["evictable_tokens"] == state["max_total_num_tokens"], state


def test_refusal_answered_while_prefill_scheduler_is_stalled(pairs: PairFactory, pin: str) -> None:
    """Prefill's scheduler is stuck in one long loop (a saturated host; the soak saw a refusal wait 3 s for it).
    Prefill's HTTP front refuses the oversized prompt itself, with the scheduler's own check and message, and
    decode's front answers its half from prefill's abort board: both long before the scheduler wakes."""
    _require_front_answers(pin)
    pair = pairs("hardened")
    trigger = pair.log_dir / PREFILL_STALL_TRIGGER
    trigger.touch()
    nudge: dict[str, PairResult] = {}  # wakes the idle scheduler, whose loop then stalls
    waking = threading.Thread(target=lambda: nudge.update(r=pair.generate(
        greedy_body(tenant_a_prompt(31, 20), 4, rid="prefill-stall-nudge"), timeout=STALL_S + 120)))
    waking.start()
    deadline = time.monotonic() + 30
    while trigger.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not trigger.exists(), "prefill's scheduler never stalled"
    b = pair.generate(greedy_body(tenant_b_prompt(SETUP.b_len), SETUP.new_tokens, rid="prefill-stalled-B"),
                      timeout=SETUP.waiting_timeout_s + 60)
    waking.join()
    for half in (b.prefill, b.decode):
        assert half.status == 400 and TOO_LONG in half.error_message(), (b.prefill.summary(), b.decode.summary())
        assert half.elapsed_s < STALL_S / 4, (
            f"B answered in {half.elapsed_s:.1f} s: it waited for prefill's stalled scheduler")
    assert nudge["r"].prefill.ok and nudge["r"].decode.ok, (nudge["r"].prefill.summary(), nudge["r"].decode.summary())


def test_rooms_failed_behind_a_failed_write_are_not_quarantined(pairs: PairFactory, pin: str) -> None:
    """A's engine call gives up (prefill marks A's decode session failed) while its bytes may still land; C, queued
    behind A for the same decode session, is failed without a byte of it written. Decode must quarantine A's pages
    and free C's at once: quarantining every room a failed session takes down held 59 pages at once in a 0.5.19
    soak (7.7 % of a decode pool, bound 2 %)."""
    _require_guard(pin, "lifecycle")
    pair = pairs("hardened")
    assert pair.prefill.bootstrap_port is not None
    late: dict[str, PairResult] = {}

    def send(name: str, seed: int, room: int) -> PairResult:
        body = greedy_body(tenant_a_prompt(seed, 60), SETUP.new_tokens, rid=f"session-{name}-{room}")
        return pd_generate(pair.prefill.url, pair.decode.url, pair.prefill.bootstrap_port, body, room=room,
                           timeout=120)

    a = threading.Thread(target=lambda: late.update(a=send("A", 21, LATE_ROOM)))
    a.start()
    _wait_for_late_send(pair.log_dir / "kvtrace", LATE_ROOM)
    c_room = 7_600_000_100 + int(time.time()) % 100_000
    c = send("C", 22, c_room)
    a.join()
    assert "session" in c.prefill.error_message() and not c.decode.ok, (
        "C was not failed behind A's failed write (scenario timing)", c.prefill.summary(), c.decode.summary())
    quarantined = quarantined_pages_by_room(pair.decode.log_text())
    if pin in FREES_A_FAILED_ROOM_AT_ONCE:
        assert quarantined.get(LATE_ROOM, 0) > 0, ("A's pages must go to quarantine", quarantined)
    assert c_room not in quarantined, ("C's pages were quarantined though nothing of C was written", quarantined)
    state = _wait_pool_full(pair.decode, timeout=LATE_DELAY_S + LATE_LIFETIME_S + 30)
    assert state["available_tokens"] + state["evictable_tokens"] == state["max_total_num_tokens"], state
    # the fault fired: A's held write was replayed (landed or failed, counted apart), so the quarantine held
    # pages a write was still aimed at
    _wait_for_trace(pair.log_dir / "kvtrace", "latewrite-",
                    lambda e: write_replayed(e) and e.get("room") == LATE_ROOM, timeout=LATE_DELAY_S + 30)
    counts = write_counts(late_writes(pair.log_dir / "kvtrace"), LATE_ROOM)
    _say(f"{pin}: A's late write {counts}")
    assert counts["late_writes_attempted"] >= 1, counts


def test_abort_crossing_the_success_gets_its_drain_ack(pairs: PairFactory, pin: str) -> None:
    """Decode gives up on R (its client went away) just as prefill concludes R: prefill has marked R's transfer a
    Success, but its worker still counts R's chunk in flight and decode has not heard of the Success yet. Decode
    holds R's pages until prefill acks the drain. On releases with ``DROPPING_BRANCH`` (Mooncake: 0.5.19, .20) prefill
    answers that abort notice with nothing (R concluded, a chunk still counted: no ack, no target kept), so
    decode's pages never came back (a CI soak ended with 272 tokens of a decode pool not back at quiesce). The
    guard keeps the target and acks once R settled. A test-only shim holds the window open: the worker's Success
    sync sleeps first."""
    if DROPPING_BRANCH not in SourceTree(release_tree(pin)).text(BACKEND_MODULES["mooncake"]):
        pytest.skip(f"{pin}: SGLang keeps the drain-ack target of a concluded room with a chunk in flight itself")
    pair = pairs("hardened")
    assert pair.prefill.bootstrap_port is not None
    room = 7_600_000_200 + int(time.time()) % 100_000
    rid = f"crossing-{room}"
    (pair.log_dir / SUCCESS_SYNC_TRIGGER).touch()
    done: dict[str, PairResult] = {}
    body = greedy_body(tenant_a_prompt(23, 60), SETUP.new_tokens, rid=rid)
    sender = threading.Thread(target=lambda: done.update(r=pd_generate(
        pair.prefill.url, pair.decode.url, pair.prefill.bootstrap_port, body, room=room, timeout=120)))
    sender.start()
    _wait_for_trace(pair.log_dir / "kvtrace", "stall-", lambda e: e.get("event") == "success_sync_delayed"
                    and e.get("room") == room)
    status, _ = http_json("POST", pair.decode.url + "/abort_request", {"rid": rid}, 30.0)
    sender.join()
    assert status == 200 and not done["r"].decode.ok, (status, done["r"].decode.summary())
    # the guard's ack goes out in a loop of prefill's scheduler; an idle one runs a loop when something asks it
    # (here: the poll; in service, the next request or health check)
    state = _wait_pool_full(pair.decode, timeout=SUCCESS_SYNC_DELAY_S + 25, wake=pair.prefill)
    assert state["available_tokens"] + state["evictable_tokens"] == state["max_total_num_tokens"], (
        "R's pages never came back to decode's pool: prefill never acked the drain", state)


def _wait_for_trace(trace_dir: Path, stem: str, match: Callable[[dict[str, Any]], bool], timeout: float = 60.0
                    ) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(match(e) for e in read_folder(trace_dir, stem, live=True)):
            return
        time.sleep(0.05)
    raise AssertionError(f"no matching {stem} trace line within {timeout} s (shim not armed?)")


def _wait_for_late_send(trace_dir: Path, room: int, timeout: float = 60.0) -> None:
    """Until the latewrite shim logged the KV send of ``room`` (its engine call is then pending)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(w.get("event") == "kv_send" and w.get("room") == room for w in late_writes(trace_dir, live=True)):
            return
        time.sleep(0.05)
    raise AssertionError(f"no KV send of room {room} within {timeout} s (latewrite shim not armed?)")


def test_pools_back_to_full_after_rejections(pairs: PairFactory, pin: str) -> None:
    pair = pairs("hardened")
    _send_a_then_b(pair, "quiesce")
    for server in (pair.prefill, pair.decode):
        state = _wait_pool_full(server)
        assert state, f"{server.name}: no sglang_harden state in /server_info (guards not armed?)"
        free = state["available_tokens"] + state["evictable_tokens"]
        assert free == state["max_total_num_tokens"], (server.name, state)
        assert state["decisions"], state


def test_guards_armed_in_scheduler_processes_via_launcher(pairs: PairFactory, pin: str) -> None:
    """SGLang spawns its scheduler (a fresh interpreter): each scheduler logs the guards' start-up line from its own
    pid, not the launcher's, and its own report (``/server_info``) lists the guards."""
    pair = pairs("hardened")
    for server in (pair.prefill, pair.decode):
        armed = [a for a in server.armed_schedulers() if a.pin == pin and a.role == server.role]
        assert armed, server.log_tail()
        assert all(a.pid != server.pid for a in armed), (server.pid, armed)
        state = server.harden_state()
        assert state.get("pin") == pin, state
        assert {"admission", "retire", "coverage", "abort_notify"} <= set(state.get("guards", [])), state


def _forged_control_requests(room: int) -> list[tuple[str, str, bytes]]:
    """What an attacker on the network would send to prefill's bootstrap port: register itself as a prefill
    rank, kill the victim's room with a forged abort notice, poison its digest, read the digest feed and the
    route table."""
    import json

    forged_rank = dict(registration(1), rank_ip="127.0.0.2")
    abort = {"room": room, "status_code": 400, "message": "forged", "sent_kv": False}
    digest = {"room": room, "rank": 0, "values": [0] * 8}
    return [
        ("PUT", "/route", json.dumps(forged_rank).encode()),
        ("PUT", "/pd_rejections", json.dumps(abort).encode()),
        ("PUT", "/sglang_harden/digest", json.dumps(digest).encode()),
        ("GET", f"/sglang_harden/digest_feed?rooms={room}", b""),
        ("GET", f"/pd_rejections?rooms={room}", b""),
        ("GET", ROUTE_TABLE_QUERY, b""),
        ("POST", "/register_dp_rank", json.dumps({"bootstrap_room": room, "dp_rank": 0}).encode()),
    ]


def _bootstrap_call(port: int, method: str, target: str, body: bytes, headers: dict[str, str] | None = None) -> int:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"http://127.0.0.1:{port}{target}", data=body or None, method=method,
                                     headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


@pytest.mark.proves("plugin", "bootstrap_auth", control="test_vanilla_control_plane_serves_callers_without_the_secret")
def test_control_plane_refuses_callers_without_the_secret(pairs: PairFactory, pin: str) -> None:
    """The testbed gives every hardened server its control-plane secret file. While a victim request is in
    flight (direct, on a room we chose, and through sglang-router), a caller without the secret gets 401 on every
    control route; the victim completes with exactly its reference output. A valid signed request replayed is
    refused. Every refusal is a decision line on prefill (its bootstrap server runs in the HTTP process)."""
    _require_guard(pin, "bootstrap_auth")
    import threading

    from sglang_harden.guards.bootstrap_auth import HEADER, parse_secrets, sign

    pair = pairs("hardened")
    for server in (pair.prefill, pair.decode):
        state = server.harden_state()
        assert state.get("control_plane_auth") == "enforce" and "bootstrap_auth" in state["guards"], state
    port = pair.prefill.bootstrap_port
    assert port is not None
    body = greedy_body(tenant_a_prompt(21, 120), SETUP.new_tokens)
    reference = pair.generate(dict(body, rid="auth-reference"))
    assert reference.decode.ok, reference.decode.summary()
    refusals_before = pair.prefill.log_text().count('"guard": "bootstrap_auth"')

    room = 4_242_000 + len(pin)
    victims: dict[str, Any] = {}
    direct = threading.Thread(target=lambda: victims.update(direct=pair.generate(dict(body, rid="auth-victim"),
                                                                                  room=room)))
    routed = threading.Thread(target=lambda: victims.update(router=pair.generate_via_router(
        dict(body, rid="auth-victim-router"))))
    direct.start()
    routed.start()
    forged = _forged_control_requests(room)
    statuses = [_bootstrap_call(port, method, target, data) for method, target, data in forged]
    direct.join(120)
    routed.join(120)
    assert statuses == [401] * len(forged), list(zip([f[1] for f in forged], statuses, strict=True))
    assert victims["direct"].decode.ok, victims["direct"].decode.summary()
    assert victims["direct"].decode.output_ids == reference.decode.output_ids
    assert victims["router"].ok and victims["router"].output_ids == reference.decode.output_ids

    secret = parse_secrets(pair.prefill.secret_file.read_text())
    target = f"/pd_rejections?rooms={room}"
    signed = {HEADER: sign(secret, "GET", f"127.0.0.1:{port}", target, b"")}
    assert _bootstrap_call(port, "GET", target, b"", signed) == 200, "a holder of the secret is served"
    assert _bootstrap_call(port, "GET", target, b"", signed) == 401, "the same token replayed"
    refusals = pair.prefill.log_text().count('"guard": "bootstrap_auth"') - refusals_before
    assert refusals == len(forged) + 1, refusals
    after = pair.generate(dict(body, rid="auth-after"))
    assert after.decode.ok and after.decode.output_ids == reference.decode.output_ids, "the route table held"


@pytest.mark.proves("plugin", "bootstrap_auth", control="test_vanilla_control_plane_serves_callers_without_the_secret")
def test_secret_rotation_without_a_failed_request(pairs: PairFactory, pin: str) -> None:
    """Rotate the control-plane secret node by node, in place, as docs/security.md says: add the next secret second
    everywhere, make it first everywhere, then drop the old one. Requests keep coming, and every one is served.
    Each process re-reads its file within a second, and a node's processes (its scheduler signs, its HTTP
    process checks) re-read at different moments. So a step may start signing with a secret only once every
    checker accepts it. The first CI run skipped the "second everywhere" step on prefill and lost a request."""
    _require_guard(pin, "bootstrap_auth")
    import secrets
    import threading

    pair = pairs("hardened")
    old, new = pair.prefill.secret_file.read_text().strip(), secrets.token_hex(32)
    steps = [(pair.decode, [old, new]), (pair.prefill, [old, new]), (pair.decode, [new, old]),
             (pair.prefill, [new, old]), (pair.decode, [new]), (pair.prefill, [new])]
    statuses: list[int] = []
    done = threading.Event()

    def traffic() -> None:
        seed = 40
        while not done.is_set():
            result = pair.generate(greedy_body(tenant_a_prompt(seed, 80), 4))
            statuses.append(result.decode.status if result.prefill.ok else result.prefill.status)
            seed += 1

    runner = threading.Thread(target=traffic)
    runner.start()
    try:
        for server, keys in steps:
            server.secret_file.write_text("\n".join(keys) + "\n")
            time.sleep(2.5)  # re-read within a second; a request or two under the new files
    finally:
        done.set()
        runner.join(120)
    assert statuses and set(statuses) == {200}, statuses
    assert "re-read" in pair.prefill.log_text(), "prefill's bootstrap server picked up each change"
    from sglang_harden.guards.bootstrap_auth import HEADER, parse_secrets, sign

    port = pair.prefill.bootstrap_port
    assert port is not None
    target = f"/pd_rejections?rooms={4_343_000 + len(pin)}"
    signed_by = {key: {HEADER: sign(parse_secrets(key), "GET", f"127.0.0.1:{port}", target, b"")} for key in (old, new)}
    assert _bootstrap_call(port, "GET", target, b"", signed_by[old]) == 401, "the retired secret still signs"
    assert _bootstrap_call(port, "GET", target, b"", {HEADER: "sgh1.forged"}) == 401, "a forged token is served"
    assert _bootstrap_call(port, "GET", target, b"", signed_by[new]) == 200, "the new secret does not sign"


def test_probe_passes_on_hardened_pair(pairs: PairFactory, pin: str) -> None:
    """The operator's end-to-end isolation probes against this hardened pair (the incident's asymmetric pools):
    admission (400 at the prefill door), retire, coverage and abort notification make every probe pass; audit
    sees the guards at work (the sizing findings stay); prefill's ``/metrics`` counts the admission rejections.
    Last of the hardened pair's tests but the alert rules' read (the probe's own traffic comes after every count the
    others read)."""
    if pin != TOOLS_PIN:
        pytest.skip(f"the operator tools' e2e cases run on {TOOLS_PIN} (test_tools_e2e.py, test_patched_incident.py)")
    pair = pairs("hardened")
    code, data = run_tool("probe", *pair_args(pair), "--seed", "7", "--max-requests", "40", "--time-budget", "400")
    probes = probe_results(data)
    assert probes["oversize"]["verdict"] == "pass", probes["oversize"]
    assert probes["cross_tenant"]["verdict"] == "pass", probes["cross_tenant"]
    assert code == 0, data
    code, audit = run_tool("audit", pair.prefill.url, pair.decode.url)
    assert all(node["armed_guards"] or node["guards"] for node in audit["nodes"]), audit
    assert "guards_missing" not in {f["code"] for f in audit["findings"]}
    exposition = alert_rules.scrape(pair.prefill.url)
    counters = parse_guard_counters(exposition)
    assert counters.get("admission", {}).get("reject", 0) >= 1, counters
    build_info = [line for line in exposition.splitlines() if line.startswith("sglang_harden_build_info{")]
    wanted = (f'version="{sglang_harden.__version__}"', f'pin="{pin}"', 'role="scheduler/prefill"', 'mode="enforce"')
    assert any(all(label in line for label in wanted) and line.endswith(" 1.0") for line in build_info), build_info
    status, info = http_json("GET", pair.prefill.url + "/server_info", timeout=10)
    assert status == 200 and {state["sglang_harden"]["version"] for state in info["internal_states"]} == {
        sglang_harden.__version__}, info


def test_alert_rules_fire_on_the_hardened_pairs_metrics(pairs: PairFactory, pin: str, tmp_path: Path) -> None:
    """The fleet's alert rules (deploy/prometheus/) over this hardened pair's real ``/metrics``, scraped right after
    its start and again after the module's traffic: the unsigned callers of
    test_control_plane_refuses_callers_without_the_secret fire SGLangHardenAuthRefusals on prefill (which needs its
    sample at 0 in the first scrape: Prometheus sees no increase in a series that first appears at 1), each
    integrity or auth alert fires exactly where a counter of its guards grew, and the pair, enforcing, fires neither
    SGLangHardenMissing, SGLangHardenGuardsNotArmed nor, a week on, SGLangHardenNotEnforcing. The controls:
    test_tools_e2e.py's vanilla pair (SGLangHardenMissing on both nodes) and test_paged_profile_e2e.py's pair with
    the checksum in log mode (SGLangHardenNotEnforcing)."""
    if pin != TOOLS_PIN:
        pytest.skip(f"the alert rules' e2e case runs on {TOOLS_PIN} only (one pin's pair with --enable-metrics)")
    if alert_rules.promtool() is None:
        pytest.skip("promtool not installed (scripts/fetch_promtool.sh fetches it)")
    pytest.importorskip("yaml")  # the rules' annotations
    pair = pairs("hardened")
    judged = alert_rules.judge_nodes({role: (FIRST_SCRAPES[pin][role], alert_rules.scrape(node.url))
                                      for role, node in (("prefill", pair.prefill), ("decode", pair.decode))},
                                     tmp_path)
    refusals = judged.expected["SGLangHardenAuthRefusals"]
    assert {"instance": "prefill", "guard": "bootstrap_auth", "decision": "reject", "severity": "warning"} in refusals
    for alert in ("SGLangHardenMissing", "SGLangHardenGuardsNotArmed", "SGLangHardenNotEnforcing"):
        assert judged.expected[alert] == [], (alert, judged.expected)
    assert judged.ok, judged.result.stdout + judged.result.stderr


def test_vanilla_serves_a_short_send(pairs: PairFactory, pin: str) -> None:
    """The coverage guard's control: prefill (auto-truncate) sends KV for 250 of the 300 tokens decode reserved, and
    vanilla decode generates over the 50 rows it never received."""
    body = greedy_body(tenant_b_prompt(SETUP.b_len), SETUP.new_tokens, rid="trunc-B-vanilla")
    v = pairs("vanilla-truncate").generate(body, timeout=SETUP.waiting_timeout_s + 60)
    assert v.prefill.ok, v.prefill.summary()
    assert v.decode.ok and v.decode.output_ids, ("vanilla no longer serves a short send", v.decode.summary())


@pytest.mark.proves("plugin", "coverage", control="test_vanilla_serves_a_short_send")
def test_short_send_caught_by_coverage(pairs: PairFactory, pin: str) -> None:
    """Auto-truncate: prefill sends KV for 250 tokens, decode reserved 300. Vanilla serves it (the control,
    test_vanilla_serves_a_short_send); hardened aborts."""
    body = greedy_body(tenant_b_prompt(SETUP.b_len), SETUP.new_tokens, rid="trunc-B")
    hardened = pairs("hardened-truncate")
    h = hardened.generate(body, timeout=SETUP.waiting_timeout_s + 60)
    _assert_decode_refused(h.decode, "prefill sent KV for 250 tokens but decode reserved 300", pin)
    assert not _decode_generated_for(hardened, "trunc-B")
    assert h.decode.elapsed_s < AFTER_FORWARD_BOUND_S, h.decode.summary()
    state = _wait_pool_full(hardened.decode)
    assert state.get("available_tokens", 0) + state.get("evictable_tokens", 0) == state["max_total_num_tokens"], state


@pytest.mark.proves("plugin", "retire", control="self")
def test_request_aborted_before_final_send_is_retired(pairs: PairFactory, pin: str) -> None:
    """Prefill aborts a request after its forward, before the final KV send (test hook). Vanilla <= 0.5.19 still
    sends the KV and "transfer complete" and decode generates for a request prefill gave up on; 0.5.20+ skips
    the send but never tells decode, which holds the reservation until its waiting timeout. Hardened retires
    it (no final send, the sender failed) and decode answers an error promptly and never generates."""
    body = greedy_body(tenant_a_prompt(5, 120), SETUP.new_tokens, rid=f"{RETIRE_PREFIX}vanilla")
    v = pairs("vanilla-truncate").generate(body, timeout=SETUP.waiting_timeout_s + 60)
    if load_pins()[pin].incident == "leak":
        assert v.decode.ok and v.decode.output_ids, ("vanilla no longer sends an aborted request", v.decode.summary())
    else:
        assert v.decode.status != 200, v.decode.summary()
        assert v.decode.elapsed_s >= 0.8 * SETUP.waiting_timeout_s, ("vanilla decode was told", v.decode.summary())
    hardened = pairs("hardened-truncate")
    body = greedy_body(tenant_a_prompt(5, 120), SETUP.new_tokens, rid=f"{RETIRE_PREFIX}hardened")
    h = hardened.generate(body, timeout=SETUP.waiting_timeout_s + 60)
    _assert_decode_refused(h.decode, "final KV", pin)
    assert h.decode.elapsed_s < AFTER_FORWARD_BOUND_S, h.decode.summary()
    assert not _decode_generated_for(hardened, f"{RETIRE_PREFIX}hardened")
    assert _retire_count(hardened.prefill) >= 1
    # decode quarantined the pages (a write may have been in flight) and gets them back once prefill acks the
    # drain; until then its door is closed to requests that would need them (the next test's)
    state = _wait_pool_full(hardened.decode)
    assert state.get("available_tokens", 0) + state.get("evictable_tokens", 0) == state["max_total_num_tokens"], state


ABORT_AS_200_PINS = ("0.4.9.post6", "0.4.10.post2")


def _assert_decode_refused(result: Any, message: str, pin: str) -> None:
    """Decode refused the request with ``message``: an HTTP error on 0.5.x; 0.4.9.post6 ends a request aborted
    after its transfer with HTTP 200, ``finish_reason`` abort and at most prefill's one output token."""
    reason = (result.meta or {}).get("finish_reason") or {}
    if result.status >= 400:
        assert message in result.error_message() and not result.output_ids, result.summary()
        return
    assert pin in ABORT_AS_200_PINS, result.summary()
    assert reason.get("type") == "abort" and message in str(reason.get("message", "")), result.summary()
    assert len(result.output_ids or []) <= 1, result.summary()


def _retire_count(server: Server) -> int:
    """Retirements prefill's scheduler decided: our retire guard (<= 0.5.19), or upstream's own retirement
    that the abort_notify hook published to decode (0.5.20+)."""
    decisions = server.harden_state().get("decisions", {})
    return sum(int(decisions.get(key, 0)) for key in ("retire:abort", "retire:reject", "abort_notify:abort"))


def test_normal_requests_unchanged(pairs: PairFactory, pin: str) -> None:
    """Greedy output of legitimate requests: hardened == vanilla, token for token (same pin, same prompts)."""
    prompts = [greedy_body(tenant_a_prompt(seed, 120), 12, rid=None) for seed in NORMAL_SEEDS]
    outputs: dict[str, list[Any]] = {}
    for kind in ("vanilla-truncate", "hardened-truncate"):
        pair = pairs(kind)
        results = [pair.generate(p) for p in prompts]
        assert all(r.decode.ok for r in results), [r.decode.summary() for r in results]
        outputs[kind] = [r.decode.output_ids for r in results]
    assert outputs["vanilla-truncate"] == outputs["hardened-truncate"]


def test_vanilla_control_plane_serves_callers_without_the_secret(pairs: PairFactory, pin: str) -> None:
    """The bootstrap_auth guard's control (last: the forged rank registration stays in this pair's table): the
    same forged requests to a vanilla prefill's bootstrap port are served, the rank registration and the route
    table read among them."""
    pair = pairs("vanilla-truncate")
    port = pair.prefill.bootstrap_port
    assert port is not None
    forged = _forged_control_requests(4_444_000 + len(pin))
    statuses = {f"{method} {target}": _bootstrap_call(port, method, target, data) for method, target, data in forged}
    assert 401 not in statuses.values(), statuses
    assert statuses["PUT /route"] == 200 and statuses[f"GET {ROUTE_TABLE_QUERY}"] == 200, statuses
