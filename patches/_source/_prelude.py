# ---- sglang-harden backport prelude: the guard's mode switch and the enum the bundled guard code needs

try:
    from enum import StrEnum
except ImportError:  # Python 3.10: the guards' verdicts are plain str enums there

    class StrEnum(str, Enum):  # type: ignore[no-redef]
        def __str__(self) -> str:
            return str(self.value)


MODES = ("enforce", "log", "off")
ROLLOUT_ENV = "SGLANG_HARDEN_MODE"
ROLLOUT_MODES = ("log", "enforce")


def series_rollout_mode() -> str:
    """SGLANG_HARDEN_MODE: log or enforce for every switch of the series at once (a switch's own variable
    overrides it), "" when unset; any other value refuses to start."""
    value = os.environ.get(ROLLOUT_ENV, "").strip().lower()
    if value and value not in ROLLOUT_MODES:
        raise ValueError(f"{ROLLOUT_ENV}={value!r}: expected one of {', '.join(ROLLOUT_MODES)}")
    return value


def mode_from_env(name: str) -> str:
    """The guard's mode from its own variable, else SGLANG_HARDEN_MODE, else enforce; any other value refuses to
    start."""
    value = os.environ.get(name, "").strip().lower() or series_rollout_mode() or "enforce"
    if value not in MODES:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(MODES)}")
    return value
