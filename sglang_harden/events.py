"""Evidence for every guard decision: one Prometheus counter sample and one structured log line.

``sglang_harden_guard_decisions_total{guard,decision,mode}`` is created lazily in the process that decides
(``mode`` is ``enforce`` or ``log``; as in the log line, a refusing decision taken in log mode ends in ``_logged``:
``reject_logged``, ``abort_logged``). :func:`prime` makes a decision's sample exist, at 0, before it first happens. When
SGLang runs with ``--enable-metrics`` it sets ``PROMETHEUS_MULTIPROC_DIR`` before spawning its scheduler, so a
counter created there shows up on the server's ``/metrics``. Without prometheus_client the counts are kept in
memory only (``snapshot()``), which the tests and ``doctor`` read.

A transfer's hot path allows every request at a few places (the ledger's publish, the page-tag check). Counting
such an ALLOW through :func:`record` (lock, counter sample, log-level check) cost ~50 us per decision with the
caches cold after a KV copy, several times the ledger's own work. Those places count through a :class:`Tally`
instead: one integer increment per decision, folded into the counts and the Prometheus counter by
:func:`snapshot` and by a background thread every ``FLUSH_INTERVAL_S``. When DEBUG logging is on for the guard
logger, a tally records every decision through :func:`record`, log line included.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import Counter
from typing import Any

from sglang_harden.config import Mode
from sglang_harden.guards.base import Decision

logger = logging.getLogger("sglang_harden.guard")

METRIC_NAME = "sglang_harden_guard_decisions"
LOG_TAG = "sglang_harden.decision"

_lock = threading.Lock()
_counts: Counter[tuple[str, str]] = Counter()
_prom_children: dict[tuple[str, str, str], object] = {}
_tallies: list[Tally] = []
FLUSH_INTERVAL_S = 1.0
_flusher: threading.Thread | None = None
_allow_lines = False  # DEBUG on for the guard logger: tallies record each decision (its log line) instead


class _LazyMetric:
    """A prometheus_client metric made on first use in the process that uses it; ``None`` for good where
    prometheus_client is missing or refuses (metrics are evidence, never a reason to fail a request or a start)."""

    def __init__(self, kind: str, name: str, doc: str, **options: Any) -> None:
        self._kind, self._name, self._doc, self._options = kind, name, doc, options
        self._metric: Any = None
        self._failed = False

    def get(self) -> Any:
        if self._metric is None and not self._failed:
            try:
                import prometheus_client

                self._metric = getattr(prometheus_client, self._kind)(self._name, self._doc, **self._options)
            except Exception:  # noqa: BLE001 - see the class docstring
                self._failed = True
        return self._metric


_decisions_counter = _LazyMetric("Counter", METRIC_NAME, "sglang-harden guard decisions",
                                 labelnames=("guard", "decision", "mode"))


def record(decision: Decision, mode: Mode, *, quiet: bool = False, **context: object) -> bool:
    """Count and log ``decision``; return True when the caller must apply it (mode is enforce).

    A guard in ``off`` mode decides nothing: no count, no log line, never applied. ``quiet``: counted, no log line
    (for input an outsider controls, whose caller logs a rate-limited summary instead)."""
    if mode is Mode.OFF:
        return False
    applied = mode is Mode.ENFORCE
    label = _label(decision, mode)
    with _lock:
        _counts[(decision.guard, label)] += 1
    child = _counter_child(decision.guard, label, mode.value)
    if child is not None:
        child.inc()  # type: ignore[attr-defined]
    level = logging.DEBUG if decision.allows else logging.WARNING
    if not quiet and logger.isEnabledFor(level):  # an allow on the hot path costs a counter bump, not a JSON dump
        logger.log(level, "%s %s", LOG_TAG, _log_line(decision, mode, label, context))
    return applied and not decision.allows


def prime(decision: Decision, mode: Mode) -> None:
    """Make ``decision``'s sample exist, at 0, before it first happens (nothing in ``off`` mode): Prometheus sees no
    increase in a series whose first sample is already 1, so an alert on the first such decision needs the 0 first."""
    if mode is not Mode.OFF:
        _counter_child(decision.guard, _label(decision, mode), mode.value)


def _label(decision: Decision, mode: Mode) -> str:
    applied = mode is Mode.ENFORCE
    return decision.verdict.value if applied or decision.allows else f"{decision.verdict.value}_logged"


class Tally:
    """The count of one constant ALLOW decision, bumped on a hot path, per mode. ``n`` (enforce) and ``n_logged``
    are written only by the thread that bumps (the scheduler's), ``folded``/``folded_logged`` only under ``_lock``:
    no increment is lost or counted twice."""

    __slots__ = ("decision", "folded", "folded_logged", "label", "n", "n_logged")

    def __init__(self, decision: Decision) -> None:
        if not decision.allows:
            raise ValueError(f"only an allowing decision is tallied, not {decision.verdict.value}")
        self.decision = decision
        self.label = decision.verdict.value
        self.n = self.n_logged = 0
        self.folded = self.folded_logged = 0
        with _lock:
            _tallies.append(self)

    def bump(self, mode: Mode, **context: object) -> None:
        """Count one decision (nothing in ``off`` mode); at DEBUG, record it with its log line."""
        if mode is Mode.OFF:
            return
        if _flusher is None:
            _start_flusher()
        if _allow_lines:
            record(self.decision, mode, **context)
        elif mode is Mode.ENFORCE:
            self.n += 1
        else:
            self.n_logged += 1


def _fold_tallies() -> None:
    """Move the tallies' new counts into the counts and the Prometheus counter."""
    with _lock:
        for tally in _tallies:
            enforced, logged = tally.n - tally.folded, tally.n_logged - tally.folded_logged
            tally.folded += enforced
            tally.folded_logged += logged
            for delta, mode in ((enforced, Mode.ENFORCE), (logged, Mode.LOG)):
                if delta:
                    _counts[(tally.decision.guard, tally.label)] += delta
                    child = _counter_child(tally.decision.guard, tally.label, mode.value)
                    if child is not None:
                        child.inc(delta)  # type: ignore[attr-defined]


def refresh_log_level() -> None:
    """Read whether ALLOW decisions get log lines (DEBUG on the guard logger); the fold thread does it each pass."""
    global _allow_lines
    _allow_lines = logger.isEnabledFor(logging.DEBUG)


def _start_flusher() -> None:
    """Start this process's fold thread once (again in a forked child)."""
    global _flusher
    refresh_log_level()
    with _lock:
        if _flusher is None:
            _flusher = threading.Thread(target=_flush_forever, name="sglang-harden-events", daemon=True)
            _flusher.start()


def _flush_forever() -> None:
    while True:
        time.sleep(FLUSH_INTERVAL_S)
        _fold_tallies()
        refresh_log_level()


def _forget_flusher_in_child() -> None:
    """A forked child has no fold thread, and a lock some parent thread held at the fork stays held: renew both."""
    global _flusher, _lock
    _flusher = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_flusher_in_child)


def _counter_child(guard: str, label: str, mode: str) -> object | None:
    """The labelled counter sample, looked up once per (guard, decision, mode) rather than once per decision."""
    child = _prom_children.get((guard, label, mode))
    if child is None:
        counter = _decisions_counter.get()
        if counter is None:
            return None
        child = counter.labels(guard=guard, decision=label, mode=mode)
        _prom_children[(guard, label, mode)] = child
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
    _fold_tallies()
    with _lock:
        return {f"{g}:{d}": n for (g, d), n in sorted(_counts.items())}


def reset_for_tests() -> None:
    with _lock:
        _counts.clear()
        for tally in _tallies:
            tally.folded, tally.folded_logged = tally.n, tally.n_logged


# ---------------------------------------------------------------- the lifecycle guard's quarantine gauge

GAUGE_NAME = "sglang_harden_quarantined_pages"
CAP_GAUGE_NAME = "sglang_harden_quarantine_cap_pages"
# one sample per live scheduler (its pid a label): each has its own pool, ledger and cap
_quarantine_gauge = _LazyMetric("Gauge", GAUGE_NAME, "KV pages held back until their writer drains",
                                multiprocess_mode="liveall")
_quarantine_cap_gauge = _LazyMetric("Gauge", CAP_GAUGE_NAME,
                                    "quarantined KV pages at which decode stops admitting new transfers",
                                    multiprocess_mode="liveall")


def set_quarantined_pages(value: int, cap: int) -> None:
    """The pages this process holds back until their writer drains, and the count at which its door closes, on
    ``/metrics`` (where prometheus_client is)."""
    for metric, sample in ((_quarantine_gauge, value), (_quarantine_cap_gauge, cap)):
        gauge = metric.get()
        if gauge is not None:
            gauge.set(sample)


# ---------------------------------------------------------------- what runs where

BUILD_INFO_NAME = "sglang_harden_build_info"
BUILD_INFO_LABELS = ("version", "pin", "family", "role", "mode")
_build_info = _LazyMetric("Gauge", BUILD_INFO_NAME,
                          "sglang-harden version, SGLang pin and rollout mode of this process",
                          labelnames=BUILD_INFO_LABELS, multiprocess_mode="max")


def publish_build_info(**labels: str) -> None:
    """``sglang_harden_build_info{version,pin,family,role,mode} 1`` on ``/metrics`` (where prometheus_client is)."""
    gauge = _build_info.get()
    if gauge is not None:
        gauge.labels(**{name: labels[name] for name in BUILD_INFO_LABELS}).set(1)
