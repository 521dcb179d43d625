"""The soak's load: the requests it makes, the threads that send them (``LoadRun``: clients, late writes, forged
control requests, abort bursts, pool sampling) and the landing of injected late writes (``LateWriteLander``)."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from sglang_harden.testbed import jsonl
from sglang_harden.testbed.latewrite_trace import late_writes, write_counts, write_replayed
from sglang_harden.testbed.soak_requests import Target, forge_control_requests, pool_of, send
from sglang_harden.testbed.soak_spec import LATE_RID_PREFIX, LATE_TRIGGER, Outcome, SoakLoad, SoakTopology


class LateWriteLander:
    """Lands each injected late write when it can hurt: as soon as another request decodes over a page the late
    request's KV send targeted, after that request's engine call failed (``touch`` of the shim's trigger file;
    without such a victim the shim lands the write after ``late_write_delay_s``). Vanilla decode hands those
    pages on once it gives up on the room, so the write lands in the victim's context; hardened decode holds
    them in quarantine, so it lands in pages no one reads. With several decode nodes page ids repeat across
    them, so only a victim on the node that took the late request in counts (the tracer's ``admitted`` lines).
    Late writes must not overlap (one trigger file); the soak spaces them ``duration / (late_writes + 1)``
    apart. A write counts as landed only with a successful status (``latewrite_trace.write_landed``)."""

    def __init__(self, trace_dir: Path) -> None:
        self.trace_dir, self.trigger = trace_dir, trace_dir / LATE_TRIGGER
        self.triggered: dict[int, str] = {}  # late room -> the victim its write was made to land for

    @property
    def fired(self) -> dict[int, str]:
        """Late room -> the victim its write landed for (a replay that failed is left out)."""
        writes = late_writes(self.trace_dir, live=True)
        return {room: rid for room, rid in self.triggered.items() if write_counts(writes, room)["late_writes_landed"]}

    def counts(self) -> dict[str, int]:
        """The late writes replayed so far: attempted, landed, failed."""
        return write_counts(late_writes(self.trace_dir, live=True))

    def step(self) -> None:
        writes = late_writes(self.trace_dir, live=True)
        over = {w.get("room") for w in writes if write_replayed(w)}
        if self.trigger.exists() and all(room in over for room in self.triggered):
            self.trigger.unlink(missing_ok=True)  # the last replay happened: ready for the next late write
        pending = {w["room"]: float(w["t"]) for w in writes
                   if w.get("event") == "engine_timeout" and w.get("room") not in over | set(self.triggered)}
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
                self.triggered[room] = str(victim["rid"])
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
