"""Reading the CUDA simulator's counts off running testbed servers (``/server_info``'s ``testbed_cudasim`` block,
``sglang_harden_cudasim`` shim): per request, between two snapshots, by (owner, kind, site)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from sglang_harden.testbed.server import Server

HARDEN = "sglang_harden"


def sim_state(server: Server) -> dict[str, Any]:
    states = server.server_info().get("internal_states") or [{}]
    return states[0].get("testbed_cudasim") or {}


def _rows(block: dict[str, Any], key: str) -> Counter[tuple[str, ...]]:
    return Counter({tuple(row[:-1]): int(row[-1]) for row in block.get(key) or []})


def per_request(before: dict[str, Any], after: dict[str, Any], n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("sites", "poisoned_sites", "async_copies"):
        diff = _rows(after, key)
        diff.subtract(_rows(before, key))
        out[key] = [[*k, round(v / n, 2)] for k, v in diff.most_common() if v > 0]
    landed = Counter(after.get("landed") or {})
    landed.subtract(before.get("landed") or {})
    out["landed"] = {k: round(v / n, 2) for k, v in landed.items() if v > 0}
    out["passes"] = round((after.get("passes", 0) - before.get("passes", 0)) / n, 2)
    out["since_start"] = {k: after.get(k) for k in ("syncs", "poisoned_reads", "marked_tensors_seen", "landed")}
    return out


def owner_rows(block: dict[str, Any], owner: str, key: str = "sites") -> list[list[Any]]:
    """The rows of ``block[key]`` (a :func:`per_request` block) that ``owner`` caused."""
    return [row for row in block.get(key) or [] if row[0] == owner]
