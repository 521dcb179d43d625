"""PLACEHOLDER (not committed): helper-6 writes the real one."""
from typing import Any


class WireRules:
    def __init__(self, backend: str, role: str, manager: Any) -> None:
        self.backend, self.role = backend, role

    def problem(self, frames: list[bytes], sender: bytes | None) -> str | None:
        return None

    def kind(self, frames: list[bytes]) -> str:
        return "unknown"
