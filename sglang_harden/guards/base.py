"""What every guard returns: a decision, plain data, no SGLang."""

from __future__ import annotations

from dataclasses import dataclass, field

from sglang_harden._pycompat import StrValueEnum


class Verdict(StrValueEnum):
    ALLOW = "allow"
    REJECT = "reject"
    ABORT = "abort"
    QUARANTINE = "quarantine"
    RELEASE = "release"
    CLAMP = "clamp"
    SKIP = "skip"


@dataclass(frozen=True)
class Decision:
    """One guard decision. ``verdict`` is what the guard wants; the mode decides whether it is applied."""

    guard: str
    verdict: Verdict
    reason: str = ""
    status_code: int | None = None
    fields: dict[str, object] = field(default_factory=dict)

    @property
    def allows(self) -> bool:
        return self.verdict in (Verdict.ALLOW, Verdict.RELEASE, Verdict.SKIP)


def allow(guard: str, **fields: object) -> Decision:
    return Decision(guard, Verdict.ALLOW, fields=dict(fields))
