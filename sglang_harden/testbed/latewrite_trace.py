"""The late-write scenario's trace: the latewrite shim's lines (A's KV send, the late write) and the trigger file
that makes the delayed write land while a victim decodes.

A ``late_write`` line says the shim replayed a held write and what the engine call (Mooncake) or the post (NIXL)
reported: ``status`` 0 is a write whose bytes reached decode's pages (:func:`write_landed`), anything else (Mooncake
< 0; NIXL ``-1``, its ``state`` not ``DONE``) a failed one: no evidence its bytes arrived. Only landed writes count as
the fault's harm; :func:`write_counts` reports both."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from sglang_harden.testbed import jsonl
from sglang_harden.testbed.incident import read_kvtrace


def late_writes(folder: Path, live: bool = False) -> list[dict[str, Any]]:
    """The latewrite shim's trace lines (live: a line still being written is left out)."""
    return jsonl.read_folder(folder, "latewrite-", live)


def send_targets(writes: list[dict[str, Any]]) -> set[int]:
    """The decode pages the delayed rooms' KV sends target (the shim's ``kv_send`` lines)."""
    return {page for w in writes if w.get("event") == "kv_send" for page in w["dst_pages"]}


def trigger_path(log_dir: Path) -> Path:
    return Path(log_dir) / "kvtrace" / "late-write-now"


class LandingTrigger:
    """Creates the trigger file (the late write then lands) once, the first time either holds:

    - a victim starts decoding over a decode page that A's KV send targeted (the shim's ``kv_send`` lines): A's
      pages were handed on while its write was in flight, and the write lands in that victim (vanilla);
    - with ``or_after_release``: a victim sent after A's release time starts decoding, whatever its pages (for a
      hardened server, whose quarantine keeps A's pages from every victim: the write lands while one decodes).

    Without either, the shim lands the write after its ``delay_s``."""

    def __init__(self, log_dir: Path, release_at: float, or_after_release: bool) -> None:
        self.trace, self.path, self.release_at = Path(log_dir) / "kvtrace", trigger_path(log_dir), release_at
        self.or_after_release = or_after_release
        self.victims: set[str] = set()
        self.eligible: set[str] = set()
        self.fired_for: str | None = None
        self.reason: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sent(self, rid: str) -> None:
        self.victims.add(rid)
        if time.time() >= self.release_at:
            self.eligible.add(rid)

    def _reason(self, event: dict[str, Any], a_pages: set[int]) -> str | None:
        rid = event.get("rid")
        if event.get("event") != "first_decode" or rid not in self.victims:
            return None
        if a_pages.intersection(event.get("pages") or ()):
            return "decodes over A's pages"
        if self.or_after_release and rid in self.eligible:
            return "sent after A's release"
        return None

    def _fire(self, rid: str, reason: str) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch()
        self.fired_for, self.reason = rid, reason

    def _run(self) -> None:
        while not self._stop.is_set() and self.fired_for is None:
            try:
                a_pages = send_targets(late_writes(self.trace, live=True))
                events = read_kvtrace(self.trace, live=True)
            except ValueError as exc:  # a broken trace line: the scenario's checks then name it
                self.reason = f"trace unreadable: {exc}"
                return
            for event in events:
                reason = self._reason(event, a_pages)
                if reason is not None:
                    self._fire(str(event["rid"]), reason)
                    return
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def await_send(trace: Path, room: int, timeout_s: float) -> None:
    """Returns once prefill started a KV send for ``room`` (the shim's ``kv_send`` line)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(w.get("event") == "kv_send" and w.get("room") == room for w in late_writes(trace, live=True)):
            return
        time.sleep(0.05)
    raise RuntimeError(f"late-write scenario: prefill did not start the KV send of room {room} within "
                       f"{timeout_s:.0f} s; nothing would be in flight at the abort")


def write_replayed(line: Mapping[str, Any]) -> bool:
    """A late write the shim replayed, landed or failed (the room's held write is then over)."""
    return line.get("event") == "late_write"


def write_landed(line: Mapping[str, Any]) -> bool:
    """A late write whose replay reported success (status 0): its bytes are in decode's pages. A line without a
    status is no evidence of a landing."""
    return write_replayed(line) and line.get("status") == 0


def write_counts(lines: Iterable[Mapping[str, Any]], room: int | None = None) -> dict[str, int]:
    """``late_writes_attempted`` (replayed), ``late_writes_landed`` and ``late_writes_failed``, of ``room`` or
    of every room."""
    replayed = [w for w in lines if write_replayed(w) and (room is None or w.get("room") == room)]
    landed_ = sum(1 for w in replayed if write_landed(w))
    return {"late_writes_attempted": len(replayed), "late_writes_landed": landed_,
            "late_writes_failed": len(replayed) - landed_}


def landed(trace: Path, room: int | None = None) -> bool:
    """At least one late write (of ``room``) landed."""
    return write_counts(late_writes(trace, live=True), room)["late_writes_landed"] > 0


def replayed(trace: Path, room: int | None = None) -> bool:
    """At least one late write (of ``room``) was replayed, landed or failed: the held write is over."""
    return write_counts(late_writes(trace, live=True), room)["late_writes_attempted"] > 0
