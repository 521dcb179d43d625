"""Bounded exhaustive exploration (breadth first, so every counterexample is a shortest one).

Visited states are remembered by their 64-bit hash together with the event that first reached them
(hash compaction, as in SPIN's bitstate mode: a collision could hide a state, at ~1e-7 odds for 1e6 states),
which keeps memory at a few dozen bytes per state. A counterexample's trace is rebuilt by replaying events.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from sglang_harden.protocol.model import PROPERTIES, Event, Model, Violation


@dataclass(frozen=True)
class Counterexample:
    prop: str
    detail: str
    events: tuple[Event, ...]
    notes: tuple[str, ...]

    def format(self) -> str:
        lines = [f"counterexample: {self.prop} -- {self.detail}", f"  property: {PROPERTIES[self.prop]}"]
        for i, ((kind, r), note) in enumerate(zip(self.events, self.notes, strict=True), 1):
            lines.append(f"  {i:2d}. {kind} r{r}: {note}" if note else f"  {i:2d}. {kind} r{r}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, object]:
        return {
            "property": self.prop,
            "detail": self.detail,
            "trace": [
                {"event": k, "request": f"r{r}", "note": n} for (k, r), n in zip(self.events, self.notes, strict=True)
            ],
        }


@dataclass
class ExploreResult:
    policy: str
    disabled: tuple[str, ...]
    states: int = 0
    transitions: int = 0
    depth_reached: int = 0
    exhausted: bool = False
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    counterexamples: dict[str, Counterexample] = field(default_factory=dict)
    stop_at_first: bool = True
    truncated: bool = False

    @property
    def first(self) -> Counterexample | None:
        return next(iter(self.counterexamples.values()), None)

    def summary(self) -> str:
        bound = "all reachable states" if self.exhausted else f"to depth {self.depth_reached}"
        found = ", ".join(self.counterexamples) or "none"
        return (
            f"policy={self.policy} disabled={','.join(self.disabled) or '-'}: {self.states:,} distinct states, "
            f"{self.transitions:,} transitions, {bound}, {self.seconds:.1f}s wall / {self.cpu_seconds:.1f}s cpu; "
            f"violations: {found}"
        )


def replay(model: Model, events: Iterable[Event]) -> tuple[tuple[str, ...], list[Violation]]:
    """Re-run ``events`` from the initial state: the trace notes and every violation seen on the way."""
    state, notes, seen = model.initial(), [], []
    for event in events:
        state, violations, note = model.step(state, event)
        notes.append(note)
        seen.extend(violations)
    return tuple(notes), seen


def explore(
    model: Model,
    depth: int,
    max_states: int | None = None,
    stop_at_first: bool = True,
    disabled: Iterable[str] = (),
    stop_when: Iterable[str] = (),
) -> ExploreResult:
    """Visit every state reachable in ``depth`` events (or until ``max_states``); collect the first
    (shortest) counterexample per property. ``stop_at_first``: stop at the first violation and do not
    explore past violating transitions; otherwise keep going (past them too) until every property in
    ``stop_when`` (default: all of them) has a counterexample."""
    targets = set(stop_when) or set(PROPERTIES)
    result = ExploreResult(model.policy.name, tuple(disabled), stop_at_first=stop_at_first)
    started, cpu_started = time.perf_counter(), time.process_time()
    root = model.initial()
    parents: dict[int, tuple[int, Event] | None] = {hash(root): None}
    frontier = [root]
    level = 0
    while frontier and level <= depth:
        result.depth_reached = level
        next_frontier: list[tuple] = []
        for state in frontier:
            if _expand(model, state, parents, next_frontier, result, level < depth):
                result.states = len(parents)
                result.seconds = time.perf_counter() - started
                result.cpu_seconds = time.process_time() - cpu_started
                if stop_at_first or targets <= set(result.counterexamples):
                    return result
            if max_states is not None and len(parents) >= max_states:
                next_frontier = []
                break
        frontier = next_frontier
        level += 1
    hit_cap = max_states is not None and len(parents) >= max_states
    result.exhausted = not frontier and not result.truncated and not hit_cap
    result.states = len(parents)
    result.seconds = time.perf_counter() - started
    result.cpu_seconds = time.process_time() - cpu_started
    return result


def _expand(
    model: Model,
    state: tuple,
    parents: dict[int, tuple[int, Event] | None],
    next_frontier: list[tuple],
    result: ExploreResult,
    go_deeper: bool,
) -> bool:
    """Check ``state`` and queue its successors; True when a new counterexample was recorded."""
    key = hash(state)
    events = model.enabled(state)
    found = False
    violation = model.check_state(state, events)
    if violation is not None:
        found |= _record(model, parents, key, None, violation, result)
    if not go_deeper:
        result.truncated = result.truncated or bool(events)
        return found
    for event in events:
        child, violations, _ = model.step(state, event)
        result.transitions += 1
        if violations:
            for violation in violations:
                found |= _record(model, parents, key, event, violation, result)
            if result.stop_at_first:
                continue
        child_key = hash(child)
        if child_key not in parents:
            parents[child_key] = (key, event)
            next_frontier.append(child)
    return found


def _path_to(parents: dict[int, tuple[int, Event] | None], key: int) -> list[Event]:
    events: list[Event] = []
    link = parents[key]
    while link is not None:
        key, event = link
        events.append(event)
        link = parents[key]
    return events[::-1]


def _record(
    model: Model,
    parents: dict[int, tuple[int, Event] | None],
    key: int,
    last: Event | None,
    violation: Violation,
    result: ExploreResult,
) -> bool:
    if violation.prop in result.counterexamples:
        return False
    events = _path_to(parents, key) + ([last] if last is not None else [])
    notes, _ = replay(model, events)
    result.counterexamples[violation.prop] = Counterexample(violation.prop, violation.detail, tuple(events), notes)
    return True


def check_policy(
    policy: str,
    config: object,
    disabled: Iterable[str] = (),
    depth: int = 40,
    max_states: int | None = None,
    stop_when: Iterable[str] = (),
    stop_at_first: bool = True,
) -> ExploreResult:
    """Build the model for ``policy`` (with ``disabled`` guards off) and explore it."""
    from sglang_harden.protocol.policies import make_policy

    disabled = tuple(disabled)
    model = Model(config, make_policy(policy, config, disabled))  # type: ignore[arg-type]
    return explore(model, depth, max_states, stop_at_first, disabled, stop_when)
