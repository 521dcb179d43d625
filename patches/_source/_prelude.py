# ---- sglang-harden backport prelude: the guard's mode switch and the enum the bundled guard code needs

try:
    from enum import StrEnum
except ImportError:  # Python 3.10: the guards' verdicts are plain str enums there

    class StrEnum(str, Enum):  # type: ignore[no-redef]
        def __str__(self) -> str:
            return str(self.value)


MODES = ("enforce", "log", "off")


def mode_from_env(name: str) -> str:
    """The guard's mode from the environment (default enforce); any other value refuses to start."""
    value = os.environ.get(name, "enforce").strip().lower() or "enforce"
    if value not in MODES:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(MODES)}")
    return value
