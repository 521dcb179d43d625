"""Soak: drive a real PD topology with mixed, hostile traffic and judge it with oracles the guards do not own.

One run = one topology (started here, or a running one described by ``sglang-harden testbed start``'s state file)
and one load for ``duration_s``: ``concurrency`` client threads, each sending one request after another for one of
``tenants`` tenants. A request is one of

- ``normal``: the tenant's shared prefix (so prefill's radix cache hits) plus a random suffix; must answer 200
  with every token it asked for;
- ``oversized``: longer than prefill's KV pool but within the context (the incident); must be refused (4xx/503)
  within ``refused_bound_s``; served with 200 is the incident;
- ``disconnect``: a normal request whose client hangs up after a random delay (during prefill, transfer or
  decode, depending on where it is by then);
- caught in an ``/abort_request`` burst: every ``abort_burst_every_s`` up to ``abort_burst_size`` in-flight normal
  requests are aborted on both servers;
- ``late_write`` (``late_writes`` of them, evenly spread; paired directly or through the router, the shim finds
  the room by the request's rid): prefill's engine call for its KV gives up after 1 s and reports failure while
  the bytes land ``late_write_delay_s`` after the send started (test-only ``latewrite`` shim): a late RDMA write
  into pages decode may already have handed to someone else. Its own answer is not judged (``faulted``).

Oracles (none of them reads sglang-harden's ledger or page tags):

- foreign reads, from the decode KV tracer shim (``sglang_harden_kvtrace``): context rows a request's first decode
  step read that hold what another request with a different token prefix left there, plus context rows changed
  under a request while it decoded (a late write);
- double frees: page ids present more than once in an allocator's free lists (testbed pool reporter);
- pages leaked at quiesce: each allocator not back to full capacity within ``quiesce_timeout_s`` of the end;
- guard refusals and quarantine: the hardened servers' own counters, reported (not used as oracles).

``compare`` runs the same load (same seed) on a vanilla and then a hardened topology and reports
hardened/vanilla ratios of throughput and latency.
"""

from __future__ import annotations

import json
import random
import re
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from sglang_harden.testbed import jsonl
from sglang_harden.testbed.client import generate, http_json
from sglang_harden.testbed.decisions import decision_lines, notify_latencies
from sglang_harden.testbed.incident import KVTRACE_ENV, WAITING_TIMEOUT_ENV, read_kvtrace
from sglang_harden.testbed.profiles import get_profile
from sglang_harden.testbed.server import HARDENED_LAUNCHER, VANILLA_LAUNCHER, PDFleet, PDPair

KINDS = ("normal", "oversized", "disconnect")
LATE_WRITE_ENV = "SGLANG_HARDEN_TESTBED_LATE_WRITE"
LATE_ROOM_BASE = 881_000_000
LATE_RID_PREFIX = "soak-late-"
LATE_TRIGGER = "late-write-now"  # in the trace folder: the shim lands a pending late write when it appears
# SGLang's answer to a request whose KV transfer failed (a failed engine call fails its whole decode session on
# Mooncake, so requests in flight beside an injected fault fail with it): an error, never someone else's KV
TRANSFER_FAILED = re.compile(r"KVTransferError|Failed to get kvcache|could be dead|is not alive|transfer failed", re.I)
REFUSED_STATUSES = range(400, 600)


@dataclass(frozen=True)
class SoakLoad:
    duration_s: float = 60.0
    # the clients go on sending past ``duration_s`` until this many requests were served in full, for at most
    # ``max_duration_s`` in all (a slow or shared machine still gives the oracles enough served requests to judge)
    min_served: int = 0
    max_duration_s: float = 0.0
    concurrency: int = 8
    tenants: int = 4
    seed: int = 0
    prefix_len: int = 64
    suffix_len: tuple[int, int] = (16, 160)
    new_tokens: tuple[int, int] = (4, 16)
    oversized_share: float = 0.05
    disconnect_share: float = 0.1
    disconnect_after_s: tuple[float, float] = (0.05, 2.0)
    abort_burst_every_s: float = 15.0
    abort_burst_size: int = 3
    refused_bound_s: float = 5.0
    # pages a decode may hold in quarantine at once, as a share of its pool
    quarantine_bound_share: float = 0.02
    request_timeout_s: float = 120.0
    quiesce_timeout_s: float = 60.0
    late_writes: int = 0
    late_write_delay_s: float = 8.0
    # every this many seconds, a caller without the control-plane secret sends forged control requests to every
    # prefill bootstrap port (an abort notice for a room in flight, a digest, reads of the feed and route table)
    forged_control_every_s: float = 0.0

    def late_rooms(self) -> list[int]:
        return [LATE_ROOM_BASE + i for i in range(self.late_writes)]

    def late_write_env(self) -> dict[str, str]:
        """Prefill env for the latewrite shim (empty without late writes)."""
        if not self.late_writes:
            return {}
        rooms = ",".join(str(r) for r in self.late_rooms())
        return {LATE_WRITE_ENV: f"{self.late_write_delay_s}:{rooms}:timeout=1.0:rid_prefix={LATE_RID_PREFIX}"}

    def late_write_trigger_env(self, trace_dir: Path) -> dict[str, str]:
        """``late_write_env`` plus the landing trigger ``LateWriteLander`` creates."""
        env = self.late_write_env()
        if env:
            env[LATE_WRITE_ENV] += f":trigger={trace_dir / LATE_TRIGGER}"
        return env


@dataclass(frozen=True)
class SoakTopology:
    """Sizes chosen so an oversized prompt fits decode and the context but not prefill's pool (the incident)."""

    pin: str
    backend: str = "mooncake"
    profile: str = "paged16"
    context_length: int = 1024
    prefill_max_total_tokens: int = 640
    # large enough that one request's pages (<= 15 of 16 tokens) stay under the 2 % quarantine bound
    decode_max_total_tokens: int = 12288
    oversized_len: tuple[int, int] = (700, 960)
    router: bool = False
    # more than one of either: a fleet behind sglang-router (the router is then always on)
    prefills: int = 1
    decodes: int = 1
    # decode's wait for a transfer that never comes: lowered from SGLang's 300 s so a run ends in minutes. Not
    # lower than 45 s: on the 2-core CI box the whole fleet stalled for 20 s while another test started a TP=2
    # server beside it, and a request whose KV was on its way waited out a 20 s timeout (HTTP 500).
    waiting_timeout_s: int = 45


@dataclass
class Outcome:
    kind: str
    rid: str
    status: int
    latency_s: float
    ttft_s: float | None = None
    tokens: int = 0
    wanted_tokens: int = 0
    aborted_by_burst: bool = False
    error: str = ""
    # a transfer fault was injected into this run (late writes): a failed transfer is then expected collateral
    faults_injected: bool = False
    # wall-clock send time (to line a request up with the servers' logs)
    sent_at: float = 0.0

    @property
    def verdict(self) -> str:
        if self.kind == "disconnect":
            return "disconnected"
        if self.kind == "late_write":
            return "faulted"
        if self.aborted_by_burst:
            return "aborted"
        if self.kind == "oversized":
            if self.status == 200:
                return "oversized_served"
            if self.status in REFUSED_STATUSES:
                return "refused"
            return "oversized_unanswered"
        if self.status == 200 and self.tokens == self.wanted_tokens:
            return "ok"
        if self.faults_injected and self.status >= 400 and TRANSFER_FAILED.search(self.error):
            return "transfer_failed"
        return "failed"


# ------------------------------------------------------------------------------------------ late-write landing


class LateWriteLander:
    """Lands each injected late write when it can hurt: as soon as another request decodes over a page the late
    request's KV send targeted, after that request's engine call failed (``touch`` of the shim's trigger file;
    without such a victim the shim lands the write after ``late_write_delay_s``). Vanilla decode hands those
    pages on once it gives up on the room, so the write lands in the victim's context; hardened decode holds
    them in quarantine, so it lands in pages no one reads. With several decode nodes page ids repeat across
    them, so only a victim on the node that took the late request in counts (the tracer's ``admitted`` lines).
    Late writes must not overlap (one trigger file); the soak spaces them ``duration / (late_writes + 1)``
    apart."""

    def __init__(self, trace_dir: Path) -> None:
        self.trace_dir, self.trigger = trace_dir, trace_dir / LATE_TRIGGER
        self.fired: dict[int, str] = {}  # late room -> the victim it landed for

    def step(self) -> None:
        writes = jsonl.read_folder(self.trace_dir, "latewrite-", live=True)
        landed = {w.get("room") for w in writes if w.get("event") == "late_write"}
        if self.trigger.exists() and all(room in landed for room in self.fired):
            self.trigger.unlink(missing_ok=True)  # the last landing happened: ready for the next late write
        pending = {w["room"]: float(w["t"]) for w in writes
                   if w.get("event") == "engine_timeout" and w.get("room") not in landed | set(self.fired)}
        if not pending:
            return
        rid_of = {w.get("room"): str(w.get("rid")) for w in writes if w.get("event") == "room_learnt"}
        for room, failed_at in pending.items():
            pages = {p for w in writes if w.get("event") == "kv_send" and w.get("room") == room
                     for p in w.get("dst_pages") or ()}
            victim = next((e for e in self._decodes_beside(rid_of.get(room)) if float(e.get("t", 0)) > failed_at
                           and pages.intersection(e.get("pages") or ())), None)
            if victim is not None:
                self.trigger.parent.mkdir(parents=True, exist_ok=True)
                self.trigger.touch()
                self.fired[room] = str(victim["rid"])
                return

    def _decodes_beside(self, late_rid: str | None) -> list[dict[str, Any]]:
        """First decode steps of other requests on the decode node that took ``late_rid`` in (each decode
        scheduler writes its own trace file); with the node unknown, none (the write lands on its timer)."""
        for path in sorted(self.trace_dir.glob("kvtrace-*.jsonl")):
            events = jsonl.read_lines(path, live=True)
            if any(e.get("event") == "admitted" and e.get("rid") == late_rid for e in events):
                return [e for e in events if e.get("event") == "first_decode"
                        and not str(e.get("rid", "")).startswith(LATE_RID_PREFIX)]
        return []


# ------------------------------------------------------------------------------------------ request driving


class Target:
    """Where requests go: a prefill and a decode URL (requests paired directly) or a router URL; ``nodes`` names
    every server (``prefill``/``decode``, or ``prefill0``, ``decode1``, ... in a fleet) for polling and aborts."""

    def __init__(self, nodes: dict[str, str], bootstrap_port: int, router_url: str | None = None,
                 bootstrap_ports: list[int] | None = None):
        self.nodes, self.bootstrap_port, self.router_url = dict(nodes), bootstrap_port, router_url
        self.bootstrap_ports = list(bootstrap_ports or [bootstrap_port])
        self.prefill_url = next(url for name, url in self.nodes.items() if name.startswith("prefill"))
        self.decode_url = next(url for name, url in self.nodes.items() if name.startswith("decode"))

    @classmethod
    def of_pair(cls, pair: PDPair) -> Target:
        assert pair.prefill.bootstrap_port is not None
        router = pair.router.url if pair.router is not None else None
        return cls({"prefill": pair.prefill.url, "decode": pair.decode.url}, pair.prefill.bootstrap_port, router)

    @classmethod
    def of_fleet(cls, fleet: PDFleet) -> Target:
        nodes = {f"prefill{i}": s.url for i, s in enumerate(fleet.prefills)}
        nodes.update({f"decode{i}": s.url for i, s in enumerate(fleet.decodes)})
        ports = [int(s.bootstrap_port or 0) for s in fleet.prefills]
        return cls(nodes, ports[0], fleet.router.url, ports)

    @classmethod
    def of_state(cls, state: dict[str, Any]) -> Target:
        router = (state.get("router") or {}).get("url")
        nodes = {"prefill": state["prefill"]["url"], "decode": state["decode"]["url"]}
        return cls(nodes, int(state["prefill"]["bootstrap_port"]), router)

    def abort(self, rid: str) -> None:
        for url in self.nodes.values():
            try:
                http_json("POST", url + "/abort_request", {"rid": rid}, timeout=10.0)
            except OSError:
                pass


def _stream(url: str, body: dict[str, Any], timeout: float) -> tuple[int, float | None, dict[str, Any], str]:
    """POST a streaming /generate; (status, time to first chunk, last chunk's meta_info, error text)."""
    start = time.monotonic()
    data = json.dumps({**body, "stream": True}).encode()
    req = urllib.request.Request(url + "/generate", data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    ttft, meta = None, {}
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for raw in resp:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    return _status_of(chunk), ttft, meta, str(chunk["error"])[:200]
                ttft = time.monotonic() - start if ttft is None else ttft
                meta = chunk.get("meta_info") or meta
        return _finish_status(meta), ttft, meta, _finish_message(meta)
    except urllib.error.HTTPError as exc:
        return exc.code, ttft, meta, exc.read()[:200].decode(errors="replace")
    except (TimeoutError, urllib.error.URLError, ConnectionError, OSError, ValueError) as exc:
        return -1, ttft, meta, repr(exc)[:200]


def _status_of(chunk: dict[str, Any]) -> int:
    err = chunk.get("error")
    code = err.get("code") if isinstance(err, dict) else None
    return int(code) if isinstance(code, int) else 500


def _finish_status(meta: dict[str, Any]) -> int:
    finish = meta.get("finish_reason") or {}
    if isinstance(finish, dict) and finish.get("type") == "abort":
        return int(finish.get("status_code") or 500)
    return 200


def _finish_message(meta: dict[str, Any]) -> str:
    finish = meta.get("finish_reason") or {}
    return str(finish.get("message") or "")[:200] if isinstance(finish, dict) else ""


def send(target: Target, body: dict[str, Any], timeout: float, room: int | None = None
         ) -> tuple[int, float | None, int, str]:
    """One request (paired directly, or through the router); the decode side streams. Returns (status, ttft,
    generated tokens, error). Status is the worse of the two halves when paired directly."""
    if target.router_url is not None:
        status, ttft, meta, err = _stream(target.router_url, body, timeout)
        return status, ttft, int(meta.get("completion_tokens") or 0), err
    room = random.randrange(2**62) if room is None else room
    paired = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": target.bootstrap_port, "bootstrap_room": room}
    box: dict[str, int] = {}
    side = threading.Thread(target=lambda: box.update(p=generate(target.prefill_url, paired, timeout).status))
    side.start()
    status, ttft, meta, err = _stream(target.decode_url, paired, timeout)
    side.join()
    prefill = box.get("p", -1)
    if status == 200 and prefill != 200:
        status, err = prefill, err or f"prefill answered {prefill}"
    return status, ttft, int(meta.get("completion_tokens") or 0), err


ROUTE_TABLE_QUERY = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
FORGED_ROUTES = ("PUT /pd_rejections", "PUT /sglang_harden/digest", "GET /sglang_harden/digest_feed",
                 "GET /sglang_harden/aborts", "GET /route")


def forge_control_requests(port: int, room: int) -> list[tuple[str, int]]:
    """Forged control requests (no token) at one bootstrap port: (route, HTTP status) each; -1 unreachable. None
    changes a vanilla server's routes: the writes go to sglang-harden's routes, which vanilla has not got."""
    abort = {"room": room, "status_code": 400, "message": "forged by the soak", "sent_kv": False}
    digest = {"room": room, "rank": 0, "values": [0] * 8}
    calls = [("PUT", "/pd_rejections", abort), ("PUT", "/sglang_harden/digest", digest),
             ("GET", "/sglang_harden/digest_feed?since=0&epoch=&wait_ms=0", None),
             ("GET", f"/pd_rejections?rooms={room}", None), ("GET", ROUTE_TABLE_QUERY, None)]
    out = []
    for (method, target, body), route in zip(calls, FORGED_ROUTES, strict=True):
        try:
            status, _ = http_json(method, f"http://127.0.0.1:{port}{target}", body, timeout=10.0)
        except OSError:
            status = -1
        out.append((route, int(status)))
    return out


def forged_summary(counts: Counter[str]) -> dict[str, Any]:
    """Forged control requests sent, refused with 401, and answered 2xx (accepted: a hole when hardened)."""
    statuses = Counter()
    for key, n in counts.items():
        statuses[int(key.rsplit(" ", 1)[1])] += n
    return {"sent": sum(counts.values()), "refused_401": statuses.get(401, 0),
            "accepted": sum(n for status, n in statuses.items() if 200 <= status < 300),
            "by_route": dict(sorted(counts.items()))}


# ------------------------------------------------------------------------------------------ the load


def tenant_prefix(tenant: int, length: int) -> list[int]:
    rng = random.Random(10_000 + tenant)
    return [rng.randrange(3, 500) for _ in range(length)]


def make_request(rng: random.Random, load: SoakLoad, topo: SoakTopology, index: int, worker: int) -> tuple[str, dict]:
    """Pick a kind and build its body (greedy, ignore_eos so the token count is known)."""
    roll = rng.random()
    kind = "oversized" if roll < load.oversized_share else (
        "disconnect" if roll < load.oversized_share + load.disconnect_share else "normal")
    tenant = rng.randrange(load.tenants)
    if kind == "oversized":
        ids = [rng.randrange(3, 500) for _ in range(rng.randint(*topo.oversized_len))]
    else:
        suffix = [rng.randrange(3, 500) for _ in range(rng.randint(*load.suffix_len))]
        ids = tenant_prefix(tenant, load.prefix_len) + suffix
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": rng.randint(*load.new_tokens), "ignore_eos": True},
        "rid": f"soak-{kind[0]}-w{worker}-{index}",
    }
    return kind, body


class LoadRun:
    """The client threads, the abort-burst thread and the pool poller of one run."""

    def __init__(self, target: Target, load: SoakLoad, topo: SoakTopology, progress: Callable[[str], None] | None,
                 trace_dir: Path | None = None):
        self.target, self.load, self.topo, self.progress = target, load, topo, progress
        self.lander = LateWriteLander(trace_dir) if load.late_writes and trace_dir is not None else None
        self.outcomes: list[Outcome] = []
        self.in_flight: dict[str, str] = {}  # rid -> kind
        self.burst_aborted: set[str] = set()
        self.samples: list[dict[str, Any]] = []
        self.rooms: dict[str, int] = {}  # rid -> bootstrap room, requests paired directly and in flight
        self.forged: Counter[str] = Counter()  # "<route> <status>" of the forged control requests
        self.lock = threading.Lock()
        self.stop_at = 0.0

    def run(self) -> float:
        start = time.monotonic()
        self.stop_at = start + self.load.duration_s
        threads = [threading.Thread(target=self._client, args=(w,), daemon=True) for w in range(self.load.concurrency)]
        threads.append(threading.Thread(target=self._late_writes, daemon=True))
        threads.append(threading.Thread(target=self._forge_control, daemon=True))
        threads.append(threading.Thread(target=self._bursts, daemon=True))
        for thread in threads:
            thread.start()
        while any(t.is_alive() for t in threads[:-1]):  # the burst thread ends at stop time
            if self.lander is not None:
                self.lander.step()
            self._sample()
            self._say(start)
            time.sleep(1.0)
        for thread in threads:
            thread.join(timeout=1.0)
        return time.monotonic() - start

    def _client(self, worker: int) -> None:
        rng = random.Random(self.load.seed * 1000 + worker)
        index = 0
        while self._clients_go_on():
            kind, body = make_request(rng, self.load, self.topo, index, worker)
            index += 1
            hang_up = kind == "disconnect"
            timeout = rng.uniform(*self.load.disconnect_after_s) if hang_up else self.load.request_timeout_s
            room = None if self.target.router_url is not None else rng.randrange(2**62)
            with self.lock:
                self.in_flight[body["rid"]] = kind
                if room is not None:
                    self.rooms[body["rid"]] = room
            t0, sent_at = time.monotonic(), time.time()
            status, ttft, tokens, err = send(self.target, body, timeout, room=room)
            outcome = Outcome(kind, body["rid"], status, time.monotonic() - t0, ttft, tokens,
                              body["sampling_params"]["max_new_tokens"], error=err,
                              faults_injected=self.load.late_writes > 0, sent_at=sent_at)
            with self.lock:
                self.in_flight.pop(body["rid"], None)
                self.rooms.pop(body["rid"], None)
                outcome.aborted_by_burst = body["rid"] in self.burst_aborted
                self.outcomes.append(outcome)

    def _clients_go_on(self) -> bool:
        now = time.monotonic()
        if now < self.stop_at:
            return True
        if now >= self.stop_at - self.load.duration_s + max(self.load.max_duration_s, self.load.duration_s):
            return False
        with self.lock:
            served = sum(1 for o in self.outcomes if o.verdict == "ok")
        return served < self.load.min_served

    def _late_writes(self) -> None:
        """One late-write request every ``duration / (late_writes + 1)`` seconds, each on its own listed room."""
        rng = random.Random(self.load.seed + 11)
        rooms = self.load.late_rooms()
        gap = self.load.duration_s / (len(rooms) + 1)
        for index, room in enumerate(rooms):
            if not _sleep_until(self.stop_at - self.load.duration_s + gap * (index + 1), self.stop_at):
                return
            _, body = make_request(rng, replace(self.load, oversized_share=0.0, disconnect_share=0.0), self.topo,
                                   index, -1)
            body["rid"] = f"{LATE_RID_PREFIX}{index}"
            t0 = time.monotonic()
            status, ttft, tokens, err = send(self.target, body, self.load.request_timeout_s, room=room)
            outcome = Outcome("late_write", body["rid"], status, time.monotonic() - t0, ttft, tokens,
                              body["sampling_params"]["max_new_tokens"], error=err)
            with self.lock:
                self.outcomes.append(outcome)

    def _forge_control(self) -> None:
        """A caller without the secret: forged control requests at every prefill bootstrap port."""
        rng = random.Random(self.load.seed + 13)
        while self.load.forged_control_every_s > 0:
            if not _sleep_until(min(time.monotonic() + self.load.forged_control_every_s, self.stop_at),
                                self.stop_at):
                return
            with self.lock:
                live = sorted(self.rooms.values())
            room = rng.choice(live) if live else rng.randrange(2**62)
            for port in self.target.bootstrap_ports:
                for route, status in forge_control_requests(port, room):
                    with self.lock:
                        self.forged[f"{route} {status}"] += 1

    def _bursts(self) -> None:
        rng = random.Random(self.load.seed + 7)
        while self.load.abort_burst_every_s > 0:
            if not _sleep_until(min(time.monotonic() + self.load.abort_burst_every_s, self.stop_at), self.stop_at):
                return
            with self.lock:
                normal = sorted(rid for rid, kind in self.in_flight.items() if kind == "normal")
                victims = rng.sample(normal, min(len(normal), self.load.abort_burst_size))
                self.burst_aborted.update(victims)
            for rid in victims:
                self.target.abort(rid)

    def _sample(self) -> None:
        sample: dict[str, Any] = {"t": time.monotonic()}
        for name, url in self.target.nodes.items():
            sample[name] = pool_of(url)
        self.samples.append(sample)

    def _say(self, start: float) -> None:
        if self.progress is None:
            return
        with self.lock:
            counts = Counter(o.verdict for o in self.outcomes)
        done = min(time.monotonic() - start, self.load.duration_s)
        width = 24
        bar = "#" * int(width * done / self.load.duration_s)
        counts_text = " ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        self.progress(f"[{bar:<{width}}] {done:4.0f}/{self.load.duration_s:.0f} s  {counts_text}")


def _sleep_until(when: float, stop_at: float) -> bool:
    while time.monotonic() < when:
        if time.monotonic() >= stop_at:
            return False
        time.sleep(0.2)
    return time.monotonic() < stop_at


def pool_of(url: str) -> dict[str, Any]:
    """The first scheduler's testbed pool numbers and sglang-harden report (empty dict when unreachable)."""
    try:
        status, body = http_json("GET", url + "/server_info", timeout=10.0)
    except OSError:
        return {}
    if status != 200 or not isinstance(body, dict):
        return {}
    state = (body.get("internal_states") or [{}])[0] or {}
    harden = state.get("sglang_harden") if isinstance(state.get("sglang_harden"), dict) else {}
    return {"pool": state.get("testbed_pool") or {}, "lifecycle": harden.get("lifecycle") or {},
            "decisions": dict(harden.get("decisions") or {})}


# ------------------------------------------------------------------------------------------ judging


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
        "failed_examples": [asdict(o) for o in outcomes if o.verdict in ("failed", "oversized_unanswered")][:5],
        "throughput_tokens_per_s": round(sum(o.tokens for o in ok) / wall_s, 2) if wall_s else None,
        "throughput_requests_per_s": round(len(ok) / wall_s, 3) if wall_s else None,
        "latency_p50_s": percentile([o.latency_s for o in ok], 50),
        "latency_p99_s": percentile([o.latency_s for o in ok], 99),
        "ttft_p50_s": percentile([o.ttft_s for o in ok if o.ttft_s is not None], 50),
        "ttft_p99_s": percentile([o.ttft_s for o in ok if o.ttft_s is not None], 99),
        "quarantine_max_pages": max(quarantine, default=0),
        "quarantine_max_share": round(max(quarantine, default=0) / decode_pages, 4),
    }


# ------------------------------------------------------------------------------------------ running


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
        if self.foreign_reads is None:
            out.append("no KV tracer: foreign reads not judged")
        elif self.foreign_reads["rows"] or self.foreign_reads["tracer_errors"]:
            out.append(f"foreign reads: {self.foreign_reads}")
        if self.forged_control.get("accepted"):
            out.append(f"the control plane accepted {self.forged_control['accepted']} forged request(s): "
                       f"{self.forged_control['by_route']}")
        by = self.summary["by_outcome"]
        for bad in ("oversized_served", "failed", "oversized_unanswered"):
            if by.get(bad):
                out.append(f"{by[bad]} request(s) {bad}")
        if self.summary["refused_over_bound"]:
            out.append(f"{self.summary['refused_over_bound']} refusal(s) slower than the bound")
        bound = float(self.load.get("quarantine_bound_share", SoakLoad.quarantine_bound_share))
        if self.summary["quarantine_max_share"] > bound:
            out.append(f"quarantine peaked at {self.summary['quarantine_max_pages']} pages"
                       f" ({self.summary['quarantine_max_share']:.2%} of a decode pool; bound {bound:.0%})")
        for role, q in self.quiesce.items():
            if q["leaked_tokens"] is None:
                out.append(f"{role}: pool not readable at quiesce (server down?): leaks and double frees unchecked")
            elif q["leaked_tokens"]:
                out.append(f"{role}: {q['leaked_tokens']} token(s) of KV not back at quiesce")
            if q["double_frees"]:
                out.append(f"{role}: {q['double_frees']} page(s) freed twice")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "violations": self.violations()}


def start_topology(topo: SoakTopology, load: SoakLoad, hardened: bool, log_dir: Path, progress: bool
                   ) -> PDPair | PDFleet:
    env = {WAITING_TIMEOUT_ENV: str(topo.waiting_timeout_s)}
    if hardened:  # the pools are deliberately smaller than the context (the incident): the gate only logs
        env.update({"SGLANG_HARDEN_ACTIVATE": "1", "SGLANG_HARDEN_CAPACITY": "log"})
    if load.late_writes:
        env.update({**load.late_write_trigger_env(log_dir / "kvtrace"), KVTRACE_ENV: str(log_dir / "kvtrace")})
        if hardened:  # the sender's bound on a timed-out write's lifetime must cover the injected delay
            env["SGLANG_HARDEN_TRANSFER_WRITE_LIFETIME_S"] = str(int(load.late_write_delay_s + 3))
    common: dict[str, Any] = dict(
        prefill_max_total_tokens=topo.prefill_max_total_tokens,
        decode_max_total_tokens=topo.decode_max_total_tokens,
        context_length=topo.context_length,
        transfer_backend=topo.backend,
        profile=get_profile(topo.profile),
        env=env,
        decode_env={KVTRACE_ENV: str(log_dir / "kvtrace")},
        launcher_module=HARDENED_LAUNCHER if hardened else VANILLA_LAUNCHER,
        log_dir=log_dir,
        progress=progress,
    )
    if topo.prefills > 1 or topo.decodes > 1:
        return PDFleet(topo.pin, prefills=topo.prefills, decodes=topo.decodes, **common).start()
    return PDPair(topo.pin, router=topo.router, **common).start()


def drive(target: Target, load: SoakLoad, topo: SoakTopology, variant: str, kvtrace_dir: Path | None,
          progress: Callable[[str], None] | None = None, log_dir: str = "") -> SoakReport:
    """Run the load against ``target`` and judge it."""
    before = {name: pool_of(url).get("decisions", {}) for name, url in target.nodes.items()}
    run = LoadRun(target, load, topo, progress, kvtrace_dir)
    wall = run.run()
    settled = quiesce(target, load.quiesce_timeout_s)
    after = {name: pool_of(url).get("decisions", {}) for name, url in target.nodes.items()}
    refusals = {role: {k: v for k, v in decision_delta(before[role], after[role]).items() if not k.endswith(":allow")}
                for role in before}
    first_decode = next(name for name in settled if name.startswith("decode"))
    decode_total = int((settled[first_decode].get("pool") or {}).get("total") or topo.decode_max_total_tokens)
    summary = summarize(run.outcomes, run.samples, wall, load, decode_total, get_profile(topo.profile).page_size)
    trace = foreign_reads(read_kvtrace(kvtrace_dir)) if kvtrace_dir is not None else None
    if log_dir:
        write_outcomes(Path(log_dir) / "outcomes.jsonl", run.outcomes)
    return SoakReport(variant, asdict(topo), asdict(load), round(wall, 1), summary, trace, settled, refusals, log_dir,
                      notify_summary(Path(log_dir)) if log_dir else {},
                      forged_summary(run.forged) if load.forged_control_every_s > 0 else {},
                      {str(room): rid for room, rid in run.lander.fired.items()} if run.lander else {})


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


def notify_summary(log_dir: Path) -> dict[str, Any]:
    """How fast decode heard of prefill's refusals and aborts in this run (from the servers' logs)."""
    prefill = [p.read_text(errors="replace") for p in sorted(log_dir.glob("prefill*.log"))]
    decode = [p.read_text(errors="replace") for p in sorted(log_dir.glob("decode*.log"))]
    gaps = list(notify_latencies(prefill, decode).values())
    return {"rooms": len(gaps), "p50_s": percentile(gaps, 50), "max_s": max(gaps, default=None)}


def run_variant(topo: SoakTopology, load: SoakLoad, hardened: bool, log_root: Path,
                progress: Callable[[str], None] | None = None) -> SoakReport:
    variant = "hardened" if hardened else "vanilla"
    log_dir = log_root / f"{topo.pin}-{topo.backend}-{variant}"
    log_dir.mkdir(parents=True, exist_ok=True)
    started = start_topology(topo, load, hardened, log_dir, progress is not None)
    target = Target.of_fleet(started) if isinstance(started, PDFleet) else Target.of_pair(started)
    try:
        return drive(target, load, topo, variant, log_dir / "kvtrace", progress, str(log_dir))
    finally:
        started.stop()


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
        ("refusals by guard", lambda r: " ".join(f"{node}:{k}={v}" for node, d in r.refusals_by_guard.items()
                                                 for k, v in d.items()) or "-"),
        ("max time to refuse (s)", lambda r: _fmt(r.summary["refused_max_s"])),
        ("decode told of refusal p50/max (s)",
         lambda r: f"{_fmt(r.notify_latency.get('p50_s'))}/{_fmt(r.notify_latency.get('max_s'))}"),
        ("late writes landed on a victim", _landings),
        ("quarantine max (pages, share)",
         lambda r: f"{r.summary['quarantine_max_pages']} ({r.summary['quarantine_max_share']:.2%})"),
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
