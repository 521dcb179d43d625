"""What the standard library gained after Python 3.10, for the plugin and the backport series on 3.10."""

from __future__ import annotations

from enum import Enum


class StrValueEnum(str, Enum):
    """``enum.StrEnum`` (Python 3.11+): members are strings, and ``str()`` is the value."""

    def __str__(self) -> str:
        return str(self.value)
