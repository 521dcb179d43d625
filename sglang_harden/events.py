"""Evidence for every guard decision: one Prometheus counter sample and one structured log line.

``sglang_harden_guard_decisions_total{guard,decision}`` is created lazily in the process that decides. When
SGLang runs with ``--enable-metrics`` it sets ``PROMETHEUS_MULTIPROC_DIR`` before spawning its scheduler, so a
counter created there shows up on the server's ``/metrics``. Without prometheus_client the counts are kept in
memory only (``snapshot()``), which the tests and ``doctor`` read.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter

from sglang_harden.config import Mode
from sglang_harden.guards.base import Decision

logger = logging.getLogger("sglang_harden.guard")

METRIC_NAME = "sglang_harden_guard_decisions"
LOG_TAG = "sglang_harden.decision"

_lock = threading.Lock()
_counts: Counter[tuple[str, str]] = Counter()
_prom_counter: object | None = None
_prom_failed = False
_prom_children: dict[tuple[str, str], object] = {}


def _prometheus_counter() -> object | None:
    global _prom_counter, _prom_failed
    if _prom_counter is not None or _prom_failed:
        return _prom_counter
    try:
        from prometheus_client import Counter as PromCounter

        _prom_counter = PromCounter(
            METRIC_NAME, "sglang-harden guard decisions", labelnames=("guard", "decision")
        )
    except Exception:  # noqa: BLE001 - metrics are evidence, never a reason to fail a request
        _prom_failed = True
    return _prom_counter


def record(decision: Decision, mode: Mode, **context: object) -> bool:
    """Count and log ``decision``; return True when the caller must apply it (mode is enforce).

    A guard in ``off`` mode decides nothing: no count, no log line, never applied."""
    if mode is Mode.OFF:
        return False
    applied = mode is Mode.ENFORCE
    label = decision.verdict.value if applied or decision.allows else f"{decision.verdict.value}_logged"
    with _lock:
        _counts[(decision.guard, label)] += 1
    child = _counter_child(decision.guard, label)
    if child is not None:
        child.inc()  # type: ignore[attr-defined]
    level = logging.DEBUG if decision.allows else logging.WARNING
    if logger.isEnabledFor(level):  # an allow on the hot path costs a counter bump, not a JSON dump
        logger.log(level, "%s %s", LOG_TAG, _log_line(decision, mode, label, context))
    return applied and not decision.allows


def _counter_child(guard: str, label: str) -> object | None:
    """The labelled counter sample, looked up once per (guard, decision) rather than once per decision."""
    child = _prom_children.get((guard, label))
    if child is None:
        counter = _prometheus_counter()
        if counter is None:
            return None
        child = counter.labels(guard=guard, decision=label)  # type: ignore[attr-defined]
        _prom_children[(guard, label)] = child
    return child


def _log_line(decision: Decision, mode: Mode, label: str, context: dict[str, object]) -> str:
    line = {
        "event": LOG_TAG,
        "guard": decision.guard,
        "decision": label,
        "mode": mode.value,
        "reason": decision.reason,
        "status_code": decision.status_code,
        "pid": os.getpid(),
        "ts": round(time.time(), 3),
        **decision.fields,
        **context,
    }
    return json.dumps(line, default=str, sort_keys=True)


def snapshot() -> dict[str, int]:
    with _lock:
        return {f"{g}:{d}": n for (g, d), n in sorted(_counts.items())}


def reset_for_tests() -> None:
    with _lock:
        _counts.clear()
