"""What one soak run is made of: its load (``SoakLoad``), its topology (``SoakTopology``) and each request's
``Outcome`` with its verdict (see ``soak`` for the run itself)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

KINDS = ("normal", "oversized", "disconnect")
LATE_WRITE_ENV = "SGLANG_HARDEN_TESTBED_LATE_WRITE"
LATE_ROOM_BASE = 881_000_000
LATE_RID_PREFIX = "soak-late-"
LATE_TRIGGER = "late-write-now"  # in the trace folder: the shim lands a pending late write when it appears
# SGLang's answer to a request whose KV transfer failed (a failed engine call fails its whole decode session on
# Mooncake, so requests in flight beside an injected fault fail with it): an error, never someone else's KV
TRANSFER_FAILED = re.compile(r"KVTransferError|Failed to get kvcache|could be dead|is not alive|transfer failed", re.I)
# a refusal counts only with a refusing guard's status and message: the admission doors and prefill's tokenizer
# (400, SGLang's own "too long" or context messages, which the guards pass on), the lifecycle quarantine cap and the
# capacity gate (503, ours); any other error on an oversized prompt (a crash's 500) is not a refusal
REFUSALS = ((400, re.compile(r"exceeds the maximum allowed length|context length", re.I)),
            (503, re.compile(r"sglang-harden|quarantin|capacity", re.I)))


def is_refusal(status: int, error: str) -> bool:
    return any(status == code and pattern.search(error or "") for code, pattern in REFUSALS)


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
    # pages a decode may hold in quarantine at once, as a share of its pool (never under what the requests aborted
    # at once can own: see ``quarantine_bound_pages``)
    quarantine_bound_share: float = 0.02
    request_timeout_s: float = 120.0
    quiesce_timeout_s: float = 60.0
    late_writes: int = 0
    late_write_delay_s: float = 8.0
    # every this many seconds, a caller without the control-plane secret sends forged control requests to every
    # prefill bootstrap port (an abort notice for a room in flight, a digest, reads of the feed and route table)
    forged_control_every_s: float = 0.0

    def largest_request_pages(self, page_size: int) -> int:
        """Pages the longest request this load sends owns at its end (prompt and every new token)."""
        tokens = self.prefix_len + self.suffix_len[1] + self.new_tokens[1]
        return -(-tokens // max(1, page_size))

    def quarantine_bound_pages(self, decode_pages: int, page_size: int) -> int:
        """The most pages a decode may hold in quarantine at one time in a run of this load: the share of its pool,
        or, where that is less, the pages of the requests that can be aborted with a transfer in flight at once
        (one abort burst, one client's disconnect, every late write), each at the load's longest. Quarantine keeps
        an aborted request's pages whole until its writer drains, so on a small pool one aborted request is over the
        share (CI's 128-page decode: one of 12 pages is 9.4%)."""
        share = int(self.quarantine_bound_share * decode_pages)
        aborted_at_once = self.abort_burst_size + 1 + self.late_writes
        return max(share, aborted_at_once * self.largest_request_pages(page_size))

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
            if is_refusal(self.status, self.error):
                return "refused"
            return "oversized_unanswered" if self.status < 400 else "oversized_failed"
        if self.status == 200 and self.tokens == self.wanted_tokens:
            return "ok"
        if self.faults_injected and self.status >= 400 and TRANSFER_FAILED.search(self.error):
            return "transfer_failed"
        return "failed"
