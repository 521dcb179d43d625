"""Late-write scenario on a real CPU PD pair: decode gives up on a transfer whose write is still in flight.

Timeline (one fresh pair per pin and variant; Mooncake TCP or NIXL (UCX over TCP) on loopback, ``backend``;
a tiny model, ``LateWriteSetup.model``):

1. warm-up request W (settles the decode pool layout);
2. request A with a fixed bootstrap room: the test-only ``latewrite`` shim makes prefill's transfer worker
   sleep ``delay_s`` before writing A's KV, then write it anyway (by default the engine call / NIXL post
   reports failure after ``engine_timeout_s`` while the write is still pending: prefill fails A and decode
   gives up on it);
3. once prefill has started A's send (the shim's ``kv_send`` line) and ``abort_after_s`` more have passed,
   decode gives up on A (``/abort_request`` on decode: the client went away); upstream
   then either frees A's pages at once (0.5.19 default) or holds them until prefill's drain ack or its
   deferred-release timeout (0.5.21+; lowered here to ``release_timeout_s`` < ``delay_s``: the timeout path);
4. victims B (greedy, long enough to still be decoding when A's write lands) are sent back to back; the decode
   pool is small enough that a victim is handed A's pages once they were freed, and A's write lands as soon as a
   victim starts decoding over one of them (the shim logs the decode pages A's send targets; the KV tracer logs
   each victim's pages). A hardened server never hands them on; there the write lands while a victim sent after
   A's release time decodes;
5. at quiesce, B is sent again on the quiet server as the reference.

Oracles: the shim's log says when and where A's late write was replayed and whether it landed (a successful
status: ``late_writes_attempted`` / ``_landed`` / ``_failed``); the KV tracer says whether B's prompt rows changed
while B decoded (``context_rows_changed``); B's greedy ids/logprobs are compared with the reference.
Corrupted requests = requests whose prompt rows changed or whose output differs from the reference.
Quiesce: decode's ``available_tokens`` back to ``max_total_num_tokens`` (and no quarantined pages).
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sglang_harden.testbed import alert_rules
from sglang_harden.testbed.client import GenResult, PairResult, greedy_body, http_json, pd_generate
from sglang_harden.testbed.decisions import quarantined_pages_by_room
from sglang_harden.testbed.incident import KVTRACE_ENV, read_kvtrace
from sglang_harden.testbed.latewrite_patched import patched_quarantined_pages, patched_quiesce
from sglang_harden.testbed.latewrite_trace import (
    LandingTrigger,
    await_send,
    late_writes,
    replayed,
    send_targets,
    trigger_path,
    write_counts,
    write_landed,
    write_replayed,
)
from sglang_harden.testbed.model import tiny_model
from sglang_harden.testbed.patched import patched_env
from sglang_harden.testbed.pd_topology import PDPair
from sglang_harden.testbed.profiles import get_profile
from sglang_harden.testbed.server import HARDENED_LAUNCHER, VANILLA_LAUNCHER

LATE_WRITE_ENV = "SGLANG_HARDEN_TESTBED_LATE_WRITE"
Progress = Callable[[str], None] | None


BACKENDS = ("mooncake", "nixl")


@dataclass(frozen=True)
class LateWriteSetup:
    # The PD transfer backend whose KV write lands late (the pin must list it in ci/pins.toml).
    backend: str = "mooncake"
    context_length: int = 512
    prefill_max_total_tokens: int = 512
    decode_max_total_tokens: int = 340
    num_reserved_decode_tokens: int = 32
    a_len: int = 150
    b_len: int = 150
    b_new_tokens: int = 24
    # The latest A's write lands after the engine call started; normally it lands earlier, when the scenario
    # sees a victim start decoding over one of A's decode pages (hardened: or one sent after A's release time;
    # LandingTrigger).
    delay_s: float = 25.0
    # The engine call for A gives up after this long and reports failure while A's bytes are still on the wire
    # (None: the write blocks the worker instead; Mooncake then serialises the pair's later transfers behind it).
    engine_timeout_s: float | None = 1.0
    # decode aborts A this long after prefill started A's (delayed) send; the send must start within
    # ``send_start_timeout_s`` of A's arrival (a loaded host prefills slowly; an abort before the send would
    # let a hardened prefill drop A untransferred, and nothing would be in flight)
    abort_after_s: float = 1.5
    send_start_timeout_s: float = 90.0
    victims_after_write_s: float = 3.0
    release_timeout_s: float = 2.0
    quarantine_cap_pages: int = 300
    # prefill's wait for decode's handshake (None: SGLang's 300 s); short where decode refuses requests at its door
    prefill_bootstrap_timeout_s: int | None = None
    room_a: int = 777_000_001
    quiesce_timeout_s: float = 60.0
    room_misowned: int = 777_000_002
    # testbed profile (sglang_harden.testbed.profiles): KV page size, radix cache, chunked prefill, early send
    profile: str = "minimal"
    # the tiny model both servers serve (testbed.model.TINY_MODELS: "mla" is MLATokenToKVPool's latent KV)
    model: str = "llama"
    # both servers with --enable-metrics; a hardened run scrapes decode's /metrics after the warm-up and again once
    # A's pages are in quarantine (``quarantine_scrapes``: the alert rules judged on a real pending late write)
    scrape_quarantine: bool = False


# Decode pool per KV page size: A's pages (kept in quarantine by a hardened server) plus one victim fit, so a
# hardened server keeps serving victims while A's write is pending; small enough that a vanilla server hands
# A's freed pages to the next victim. Page 16 rounds A and the victim up to whole pages (340 would make victims
# wait for A's quarantine to end, after the write's own deadline: nothing would land while a victim decodes).
DECODE_POOL_BY_PAGE_SIZE = {1: 340, 16: 384}


def late_write_cases(pins: list[str], backends: list[str], profiles: list[str]) -> list[str]:
    """Test cases ``<pin>/<backend>/<profile>``, profile-major, for the backends each pin's testbed has."""
    from sglang_harden.testbed.envs import get_recipe

    return [f"{pin}/{backend}/{profile}" for profile in profiles for pin in pins for backend in backends
            if backend in get_recipe(pin).transfer_backends]


def setup_for(profile: str, backend: str = "mooncake") -> LateWriteSetup:
    """The scenario's sizes for a testbed profile (``sglang_harden.testbed.profiles``)."""
    page_size = get_profile(profile).page_size
    if page_size not in DECODE_POOL_BY_PAGE_SIZE:
        raise ValueError(f"late-write scenario: no decode pool size measured for page size {page_size} "
                         f"(profile {profile!r}); known: {sorted(DECODE_POOL_BY_PAGE_SIZE)}")
    return LateWriteSetup(backend=backend, profile=profile,
                          decode_max_total_tokens=DECODE_POOL_BY_PAGE_SIZE[page_size])


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(length)]


def start_pair(pin: str, hardened: bool, setup: LateWriteSetup, log_dir: Path, router: bool = False,
               tree: Path | None = None) -> PDPair:
    """``tree``: a patched copy of the pin's SGLang (``testbed.patched.patched_tree``) both servers run, with the
    plugin off (``hardened`` must then be False): the backport series' lifecycle instead of the plugin's."""
    if tree is not None and hardened:
        raise ValueError("a patched pair runs with the plugin off: hardened=False with tree")
    env = {
        LATE_WRITE_ENV: f"{setup.delay_s}:{setup.room_a}"
        + (f":timeout={setup.engine_timeout_s}" if setup.engine_timeout_s is not None else "")
        + f":trigger={trigger_path(log_dir)}",
        KVTRACE_ENV: str(log_dir / "kvtrace"),
        "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": str(setup.release_timeout_s),
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "120",
    }
    if hardened:
        env.update(
            {
                "SGLANG_HARDEN_ACTIVATE": "1",
                "SGLANG_HARDEN_CAPACITY": "log",
                "SGLANG_HARDEN_TESTBED_MISOWN_ROOM": str(setup.room_misowned),
                # the sender's bound on a timed-out write's lifetime: must cover the injected delay
                "SGLANG_HARDEN_TRANSFER_WRITE_LIFETIME_S": str(int(setup.delay_s + 3)),
                "SGLANG_HARDEN_QUARANTINE_CAP_PAGES": str(setup.quarantine_cap_pages),
            }
        )
    if tree is not None:
        env.update({**patched_env(tree), "SGLANG_HARDEN_CAPACITY": "log",
                    "SGLANG_HARDEN_TRANSFER_WRITE_LIFETIME_S": str(int(setup.delay_s + 3)),
                    "SGLANG_HARDEN_QUARANTINE_CAP_PAGES": str(setup.quarantine_cap_pages)})
    if setup.prefill_bootstrap_timeout_s is not None:
        env["SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"] = str(setup.prefill_bootstrap_timeout_s)
    if setup.backend not in BACKENDS:
        raise ValueError(f"late-write backend {setup.backend!r}: one of {BACKENDS}")
    model_path, model_flags = tiny_model(pin, setup.model)
    flags = (*model_flags, *(("--enable-metrics",) if setup.scrape_quarantine else ()))
    pair = PDPair(
        pin,
        transfer_backend=setup.backend,
        prefill_max_total_tokens=setup.prefill_max_total_tokens,
        decode_max_total_tokens=setup.decode_max_total_tokens,
        context_length=setup.context_length,
        num_reserved_decode_tokens=setup.num_reserved_decode_tokens,
        profile=get_profile(setup.profile),
        env=env,
        launcher_module=HARDENED_LAUNCHER if hardened else VANILLA_LAUNCHER,
        router=router,
        log_dir=log_dir,
        progress=True,
        prefill_flags=flags,
        decode_flags=flags,
        model_path=model_path,
    )
    return pair.start()


def _pool(pair: PDPair) -> dict[str, Any]:
    info = pair.decode.server_info()
    state = (info.get("internal_states") or [{}])[0]
    harden = state.get("sglang_harden") or {}
    return {
        "max_total_num_tokens": info.get("max_total_num_tokens"),
        "available_tokens": harden.get("available_tokens", (state.get("memory_usage") or {}).get("token_capacity")),
        "lifecycle": harden.get("lifecycle"),
        "decisions": harden.get("decisions"),
    }


def _quiesce(pair: PDPair, setup: LateWriteSetup) -> dict[str, Any]:
    deadline = time.monotonic() + setup.quiesce_timeout_s
    pool = _pool(pair)
    while time.monotonic() < deadline:
        pool = _pool(pair)
        lc = pool.get("lifecycle") or {}
        if pool.get("available_tokens") is None or (
            pool["available_tokens"] >= (pool["max_total_num_tokens"] or 0) and not lc.get("quarantined_pages")
        ):
            break
        time.sleep(1.0)
    return pool


def _abort_on_decode(pair: PDPair, rid: str) -> int:
    status, _ = http_json("POST", pair.decode.url + "/abort_request", {"rid": rid}, 30.0)
    return status


def _b_summary(res: GenResult) -> dict[str, Any]:
    return {
        "status": res.status,
        "ids": res.output_ids,
        "logprobs": [round(x, 5) for x in res.logprobs or []],
        "elapsed_s": res.elapsed_s,
    }


def run_scenario(
    pair: PDPair, setup: LateWriteSetup, say: Progress = None, land_after_release: bool = False,
    patched: bool = False, scrape_quarantine: bool = False,
) -> dict[str, Any]:
    """The timeline above on ``pair``. ``land_after_release``: the write also lands while any victim sent after
    A's release time decodes (:class:`LandingTrigger`; for hardened servers), not only in one handed A's pages.
    ``scrape_quarantine``: decode's /metrics after the warm-up and once A's pages are in quarantine."""
    say = say or (lambda _m: None)
    bport = int(pair.prefill.bootstrap_port or 0)

    def victim(rid: str) -> PairResult:
        body = greedy_body(_prompt(2, setup.b_len), setup.b_new_tokens, rid=rid)
        return pd_generate(pair.prefill.url, pair.decode.url, bport, body, timeout=300)

    pd_generate(pair.prefill.url, pair.decode.url, bport, greedy_body(_prompt(5, 40), 4, rid="W0"))
    first_scrape = alert_rules.scrape(pair.decode.url) if scrape_quarantine else None
    t0 = time.time()
    a_box: dict[str, PairResult] = {}
    body_a = greedy_body(_prompt(1, setup.a_len), 8, rid="A-late")
    thread = threading.Thread(
        target=lambda: a_box.setdefault(
            "a", pd_generate(pair.prefill.url, pair.decode.url, bport, body_a, room=setup.room_a, timeout=120)
        ),
        daemon=True,
    )
    thread.start()
    trace = pair.log_dir / "kvtrace"
    await_send(trace, setup.room_a, setup.send_start_timeout_s)
    time.sleep(setup.abort_after_s)
    abort_status = _abort_on_decode(pair, "A-late")
    say(f"A aborted on decode at +{time.time() - t0:.1f}s (HTTP {abort_status})")
    scrapes = (first_scrape, _scrape_once_quarantined(pair, setup)) if scrape_quarantine else None
    victims: dict[str, PairResult] = {}
    # A's pages are back in vanilla's free list at the abort (<= 0.5.20) or after the release timeout (0.5.21+)
    trigger = LandingTrigger(pair.log_dir, time.time() + setup.release_timeout_s + 0.5, land_after_release)
    latest = time.time() + setup.delay_s + setup.victims_after_write_s + 60
    over_at: float | None = None
    try:  # back-to-back victims until the late write was replayed (landed or failed), then a few more
        while time.time() < latest and (over_at is None or time.time() < over_at + setup.victims_after_write_s):
            rid = f"B{len(victims)}"
            trigger.sent(rid)
            victims[rid] = victim(rid)
            say(f"{rid} answered {victims[rid].decode.status} at +{time.time() - t0:.1f}s")
            if over_at is None and replayed(trace, setup.room_a):
                over_at = time.time()
    finally:
        trigger.stop()
    say(f"late write triggered by {trigger.fired_for or 'no victim (timer fallback)'} ({trigger.reason})")
    thread.join(timeout=setup.delay_s + 60)
    pool = _quiesce(pair, setup)
    if patched:
        pool = patched_quiesce(pair, setup, pool, say, _prompt(4, setup.decode_max_total_tokens))
    ref = victim("B-reference")
    misowned = pd_generate(
        pair.prefill.url,
        pair.decode.url,
        bport,
        greedy_body(_prompt(3, 60), 8, rid="M-misowned"),
        room=setup.room_misowned,
        timeout=120,
    )
    return {
        "t0": t0,
        "triggered_by": trigger.fired_for,
        "trigger_reason": trigger.reason,
        "a": a_box.get("a"),
        "victims": victims,
        "ref": ref,
        "pool": pool,
        "abort_status": abort_status,
        "misowned": misowned,
        "quarantine_scrapes": scrapes,
    }


def _scrape_once_quarantined(pair: PDPair, setup: LateWriteSetup) -> str | None:
    """Decode's /metrics as soon as it holds pages in quarantine (None: it held none within the release window)."""
    deadline = time.time() + setup.release_timeout_s + 5.0
    while time.time() < deadline:
        if int((pair.decode.pool().get("harden_lifecycle") or {}).get("quarantined_pages") or 0):
            return alert_rules.scrape(pair.decode.url)
        time.sleep(0.2)
    return None


def judge(run: dict[str, Any], trace_dir: Path) -> dict[str, Any]:
    ref = _b_summary(run["ref"].decode)
    trace = read_kvtrace(trace_dir)
    releases = {e["rid"]: e for e in trace if e.get("event") == "release"}
    first_decodes = {e["rid"]: e for e in trace if e.get("event") == "first_decode"}
    writes = late_writes(trace_dir)
    a_pages = send_targets(writes)
    landed_at = next((w["t"] for w in writes if write_landed(w)), None)
    over_at = next((w["t"] for w in writes if write_replayed(w)), None)
    victims: dict[str, dict[str, Any]] = {}
    for rid, pair_result in run["victims"].items():
        b = _b_summary(pair_result.decode)
        changed = (releases.get(rid) or {}).get("context_rows_changed")
        differs = (
            b["status"] == 200 and ref["status"] == 200 and (b["ids"], b["logprobs"]) != (ref["ids"], ref["logprobs"])
        )
        victims[rid] = {
            "status": b["status"],
            "elapsed_s": round(b["elapsed_s"], 2),
            "context_rows_changed": changed,
            "output_differs_from_reference": differs,
            "pages_shared_with_a": len(set((first_decodes.get(rid) or {}).get("pages") or ()) & a_pages),
            "decoded_before_write_landed": _before(first_decodes.get(rid), over_at),
            "corrupted": bool(changed) or differs,
        }
    pool = run["pool"]
    if "patched_release_logged" in pool:  # a patched decode: its release line and a request needing the pool
        back = bool(pool["patched_release_logged"]) and pool["full_pool_request_status"] == 200
    else:
        back = (pool.get("available_tokens") is not None
                and pool["available_tokens"] >= (pool["max_total_num_tokens"] or 0))
    return {
        **write_counts(writes),
        "late_write_landed": landed_at is not None,
        "late_write_t_rel": None if landed_at is None else round(landed_at - run["t0"], 2),
        "late_write_triggered_by": run.get("triggered_by"),
        "late_write_trigger_reason": run.get("trigger_reason"),
        "a_decode_pages": sorted(a_pages),
        "victims": victims,
        "served_requests": sum(1 for v in victims.values() if v["status"] == 200),
        "corrupted_requests": sum(1 for v in victims.values() if v["corrupted"]),
        "context_rows_changed": sum(int(v["context_rows_changed"] or 0) for v in victims.values()),
        "pages_back_at_quiesce": back,
        "handed_a_pages_before_write_landed": sorted(
            rid for rid, v in victims.items() if v["pages_shared_with_a"] and v["decoded_before_write_landed"]
        ),
        "tracer_gaps": sorted(rid for rid, v in victims.items()
                              if v["status"] == 200 and v["context_rows_changed"] is None),
        "a_pages_quarantined": _quarantined_pages(run.get("decode_log", ""), run.get("room_a")),
        "decode_pool": pool,
        "misowned_page_request": _misowned(run["misowned"].decode),
    }


def _before(first_decode: dict[str, Any] | None, over_at: float | None) -> bool | None:
    """Whether a victim started decoding while A's write was still held (never replayed: it still is)."""
    if first_decode is None:
        return None
    return over_at is None or float(first_decode["t"]) < over_at


def _quarantined_pages(decode_log: str, room: int | None) -> int:
    """Pages of A's room the lifecycle guard put in quarantine: the plugin's structured decision lines, or the
    backport series' log lines (a patched decode)."""
    if room is None:
        return 0
    return quarantined_pages_by_room(decode_log).get(room, 0) + patched_quarantined_pages(decode_log, room)


def _misowned(res: GenResult) -> dict[str, Any]:
    return {
        "status": res.status,
        "output_tokens": len(res.output_ids or []),
        "error": res.error_message()[:300] if res.status != 200 else None,
    }


def run_late_write(
    pin: str, hardened: bool, log_dir: Path, setup: LateWriteSetup = LateWriteSetup(), say: Progress = None,
    tree: Path | None = None,
) -> dict[str, Any]:
    """One fresh pair for (pin, variant): the scenario, the oracles, and the pair stopped again. ``tree``: the
    pair runs that patched SGLang copy, plugin off (variant ``patched``)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    pair = start_pair(pin, hardened, setup, log_dir, tree=tree)
    try:
        run = run_scenario(pair, setup, say, land_after_release=hardened or tree is not None,
                           patched=tree is not None, scrape_quarantine=setup.scrape_quarantine and hardened)
    finally:
        pair.stop()
    run.update(decode_log=pair.decode.log_text(), room_a=setup.room_a)
    result = judge(run, log_dir / "kvtrace")
    result.update(
        {
            "quarantine_scrapes": run["quarantine_scrapes"],
            "pin": pin,
            "backend": setup.backend,
            "variant": "patched" if tree is not None else "hardened" if hardened else "vanilla",
            "setup": asdict(setup),
            "log_dir": str(log_dir),
        }
    )
    result["verdict"] = ("corrupted" if result["corrupted_requests"] else "clean") + (
        "" if result["pages_back_at_quiesce"] else ", pages missing at quiesce"
    ) + ("" if result["late_writes_landed"] else
         f", late write never landed ({result['late_writes_attempted']} attempted, "
         f"{result['late_writes_failed']} failed)")
    return result


def vanilla_harmed(res: dict[str, Any]) -> bool:
    """The control's harm: A's write landed (a successful status) and changed rows of a victim's prompt KV while it
    decoded."""
    return res["late_writes_landed"] >= 1 and res["context_rows_changed"] > 0 and res["corrupted_requests"] >= 1


def brief(res: dict[str, Any]) -> str:
    """What a failed assertion needs to be diagnosed from CI output alone (pytest cuts long dict reprs)."""
    keys = ("late_writes_attempted", "late_writes_landed", "late_writes_failed", "late_write_t_rel",
            "late_write_triggered_by", "late_write_trigger_reason", "victims", "corrupted_requests",
            "context_rows_changed", "a_decode_pages", "a_pages_quarantined", "handed_a_pages_before_write_landed",
            "tracer_gaps", "pages_back_at_quiesce", "decode_pool", "log_dir", "attempts")
    return json.dumps({k: res.get(k) for k in keys}, default=str)


def collect_report(
    pins: list[str],
    variants: tuple[str, ...] = ("vanilla", "hardened"),
    setup: LateWriteSetup = LateWriteSetup(),
    root: Path | None = None,
    say: Progress = None,
) -> dict[str, Any]:
    """``{"scenario": "late-write", "backend": …, "pins": {pin: {variant: result}}, "ok": bool}``; pairs run one
    at a time, all on ``setup.backend``.

    ``ok``: every hardened run is clean with every page back at quiesce and no run errored (what CI gates on;
    for ``sglang-harden demo --scenario late-write``)."""
    import tempfile

    say = say or (lambda _m: None)
    root = root or Path(tempfile.mkdtemp(prefix="sglang-harden-latewrite-"))
    report: dict[str, Any] = {"scenario": "late-write", "backend": setup.backend, "pins": {}, "ok": True}
    for pin in pins:
        report["pins"][pin] = {}
        for variant in variants:
            say(f"{pin} {variant}: starting (logs {root / pin / variant})")
            started = time.monotonic()
            try:
                res = run_late_write(pin, variant == "hardened", root / pin / variant, setup, say)
            except Exception as exc:  # noqa: BLE001 - one broken pin must not hide the others
                res = {"verdict": "error", "error": f"{type(exc).__name__}: {exc}"[:2000]}
            res["wall_s"] = round(time.monotonic() - started, 1)
            report["pins"][pin][variant] = res
            say(f"{pin} {variant}: {res.get('verdict')}")
            if res.get("verdict") == "error" or (variant == "hardened" and res.get("verdict") != "clean"):
                report["ok"] = False
    return report


def print_report(report: dict[str, Any], as_json: bool) -> None:
    """``report`` (from :func:`collect_report`) as one JSON document or one line per pin and variant."""
    if as_json:
        print(json.dumps(report, default=str))
        return
    for pin, variants in report["pins"].items():
        for variant, res in variants.items():
            print(f"{pin:8} {report['backend']:8} {variant:9} served={res.get('served_requests')} "
                  f"corrupted={res.get('corrupted_requests')} rows_changed={res.get('context_rows_changed')} "
                  f"late_writes={res.get('late_writes_landed')}/{res.get('late_writes_attempted')} landed "
                  f"late_write_at={res.get('late_write_t_rel')}s "
                  f"pages_back={res.get('pages_back_at_quiesce')} verdict={res.get('verdict')}")
