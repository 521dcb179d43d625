"""sglang-harden's structured decision lines, read back from server logs (testbed and soak judging).

Every guard decision is logged as ``sglang_harden.decision {json}`` with a wall-clock ``ts`` (ms). Prefill and
decode run on one host in the testbed, so the gap between prefill refusing a room and decode acting on the notice
for that room is read straight off their two logs: how long decode held pages for a request prefill had refused.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from sglang_harden.events import LOG_TAG


def decision_lines(log_text: str) -> list[dict[str, Any]]:
    """Every decision line of a server log, as dicts (lines cut short by a crash are skipped)."""
    out = []
    for line in log_text.splitlines():
        _, tag, rest = line.partition(LOG_TAG + " ")
        if not tag:
            continue
        try:
            out.append(json.loads(rest))
        except ValueError:
            continue
    return out


def quarantined_pages_by_room(log_text: str) -> dict[int, int]:
    """Pages the lifecycle guard put in quarantine per room (its decisions owned ``room:<id>``), from one log."""
    pages: dict[int, int] = {}
    for decision in decision_lines(log_text):
        owner = str(decision.get("owner") or "")
        if decision.get("guard") == "lifecycle" and decision.get("decision") == "quarantine" and owner.startswith(
                "room:"):
            room = int(owner.removeprefix("room:"))
            pages[room] = pages.get(room, 0) + int(decision.get("pages") or 0)
    return pages


def notify_latencies(prefill_logs: Iterable[str], decode_logs: Iterable[str]) -> dict[int, float]:
    """Per room: seconds from prefill's first refusal or abort of the room to decode's ``abort_notify`` abort of
    it (rooms decode never heard of are left out; the caller compares counts)."""
    refused: dict[int, float] = {}
    for text in prefill_logs:
        for line in decision_lines(text):
            if line.get("decision") not in ("allow", None) and line.get("room") is not None:
                room = int(line["room"])
                refused[room] = min(refused.get(room, float("inf")), float(line["ts"]))
    told: dict[int, float] = {}
    for text in decode_logs:
        for line in decision_lines(text):
            if line.get("guard") == "abort_notify" and line.get("decision") == "abort" and line.get("room") is not None:
                room = int(line["room"])
                told[room] = min(told.get(room, float("inf")), float(line["ts"]))
    return {room: round(told[room] - refused[room], 3) for room in refused if room in told}
