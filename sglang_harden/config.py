"""One configuration shared by every process: ``--harden-*`` flags and ``SGLANG_HARDEN_*`` env vars.

The launcher turns its ``--harden-*`` flags into env vars so that spawned SGLang processes (scheduler,
detokenizer) read the same settings through :func:`load_config`.
"""

from __future__ import annotations

import difflib
import logging
import os
from dataclasses import dataclass, field, fields

from sglang_harden._pycompat import StrValueEnum

logger = logging.getLogger("sglang_harden")

ENV_PREFIX = "SGLANG_HARDEN_"
ACTIVATE_ENV = "SGLANG_HARDEN_ACTIVATE"
# One switch for every guard and the capacity gate (log: decide and count, refuse nothing); a guard's own
# variable overrides it.
MODE_ENV = "SGLANG_HARDEN_MODE"
ROLLOUT_MODES = ("log", "enforce")
# SGLANG_HARDEN_* names read outside HardenConfig: the plugin's own switches, then the tools' and the test suite's
# (servers started by the tools and tests inherit them). Any other name refuses to start (a mistyped setting must
# not silently leave a guard at its default).
OTHER_VARIABLES = frozenset({
    "ACTIVATE", "MODE", "TIME_HOOKS", "NATIVE_DIGEST", "NATIVE_LEDGER",
    "HOME", "PATCHES", "PINS", "PINS_FILE", "MIN_FREE_GB", "TORCH_WHEEL",
    "MATRIX_RESULTS", "FULL_RUN", "STRICT_SKIPS", "TEST_WORKERS", "TEST_PROFILES", "E2E_PIN", "MODEL_PROFILE",
    "FUZZ_EXAMPLES", "WIRE_FUZZ_EXAMPLES",
})
TESTBED_PREFIX = ENV_PREFIX + "TESTBED_"  # the CPU testbed's fault injection and tracing, never set on a fleet


class Mode(StrValueEnum):
    ENFORCE = "enforce"
    LOG = "log"
    OFF = "off"


class CapacityMode(StrValueEnum):
    ENFORCE = "enforce"
    CLAMP = "clamp"
    LOG = "log"
    OFF = "off"


GUARDS: tuple[str, ...] = (
    "admission",
    "retire",
    "coverage",
    "abort_notify",
    "lifecycle",
    "checksum",
    "canary",
    "page_tags",
    "bootstrap_auth",
    "zmq_auth",
    "side_channels",
)


class ConfigError(ValueError):
    """A setting has a value we cannot act on."""


@dataclass(frozen=True)
class HardenConfig:
    admission: Mode = Mode.ENFORCE
    retire: Mode = Mode.ENFORCE
    coverage: Mode = Mode.ENFORCE
    abort_notify: Mode = Mode.ENFORCE
    lifecycle: Mode = Mode.ENFORCE
    checksum: Mode = Mode.ENFORCE
    canary: Mode = Mode.ENFORCE
    page_tags: Mode = Mode.ENFORCE
    bootstrap_auth: Mode = Mode.ENFORCE
    # The ZMQ side channels (rank ports): signed and verified with the bootstrap secret (armed only with it);
    # zmq_sign=False verifies what is signed and signs nothing (the first step of a rollout).
    zmq_auth: Mode = Mode.ENFORCE
    zmq_sign: bool = True
    side_channels: Mode = Mode.ENFORCE
    capacity: CapacityMode = CapacityMode.ENFORCE
    allow_unknown_pin: bool = False
    quarantine_cap_pages: int = 0
    transfer_window_pages: int = 1024
    # How long a write the transport reported failed (timed out) may still land: the sender's bound on a posted
    # write's lifetime (RDMA: QP timeout x retries). Until then prefill neither acks the drain nor frees sources.
    # 0 = never: such pages stay quarantined on decode until the sender is known gone.
    transfer_write_lifetime_s: int = 30
    # How long decode waits at a commit for the digest of a prefill that publishes digests (its answer is
    # normally there already: prefill posts before it sends). Past it the checksum guard refuses the request.
    checksum_wait_ms: int = 5000
    # A file with the PD deployment's control-plane secret (the signing one first, one more accepted during a
    # rotation). Never the secret itself on a command line or in the environment. Empty: the control plane is
    # unauthenticated and the bootstrap_auth guard is not armed.
    bootstrap_secret_file: str = ""
    bootstrap_auth_max_age_s: int = 60
    # Names (host:port, comma-separated; *:port any host on a port; * any) that also name this bootstrap server,
    # beyond its bind host, host name, FQDN and the address a connection arrives on: DNS aliases, Services.
    bootstrap_authorities: str = ""
    # Accept sgh1 tokens (no Host binding; signers from before issue 39) while a deployment rolls out.
    bootstrap_auth_accept_sgh1: bool = False
    extra: dict[str, str] = field(default_factory=dict)

    def mode(self, guard: str) -> Mode:
        return getattr(self, guard)

    def active_guards(self) -> list[str]:
        return [g for g in GUARDS if self.mode(g) is not Mode.OFF]


def _parse_field(name: str, raw: str, default: object) -> object:
    try:
        if isinstance(default, CapacityMode):
            return CapacityMode(raw.strip().lower())
        if isinstance(default, Mode):
            return Mode(raw.strip().lower())
        if isinstance(default, bool):
            return raw.strip().lower() in ("1", "true", "yes", "on")
        if isinstance(default, int):
            value = int(raw)
            if value < 0:
                raise ValueError("must be >= 0")
            return value
    except ValueError as exc:
        raise ConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r}: {exc}") from None
    return raw


def setting_names() -> frozenset[str]:
    """Every ``SGLANG_HARDEN_*`` name sglang-harden reads (the testbed's ``SGLANG_HARDEN_TESTBED_*`` aside)."""
    return frozenset(ENV_PREFIX + f.name.upper() for f in fields(HardenConfig) if f.name != "extra") | frozenset(
        ENV_PREFIX + name for name in OTHER_VARIABLES)


def check_setting_names(environ: dict[str, str] | os._Environ[str]) -> None:
    """Raise ConfigError naming each unknown ``SGLANG_HARDEN_*`` variable and the nearest known name."""
    known = setting_names()
    suffixes = [known_name.removeprefix(ENV_PREFIX) for known_name in known]
    problems = []
    for name in sorted(environ):
        if not name.startswith(ENV_PREFIX) or name in known or name.startswith(TESTBED_PREFIX):
            continue
        nearest = difflib.get_close_matches(name.removeprefix(ENV_PREFIX), suffixes, n=1, cutoff=0.6)
        problems.append(name + (f" (did you mean {ENV_PREFIX}{nearest[0]}?)" if nearest else ""))
    if problems:
        raise ConfigError("unknown setting " + ", ".join(problems) + "; known settings: docs/configuration.md")


def rollout_mode(environ: dict[str, str] | os._Environ[str]) -> Mode | None:
    """``SGLANG_HARDEN_MODE`` (log or enforce), or None when unset."""
    raw = environ.get(MODE_ENV)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value not in ROLLOUT_MODES:
        raise ConfigError(f"{MODE_ENV}={raw!r}: must be one of {', '.join(ROLLOUT_MODES)}")
    return Mode(value)


def load_config(environ: dict[str, str] | None = None) -> HardenConfig:
    """Read the configuration from ``SGLANG_HARDEN_<FIELD>`` env vars (``SGLANG_HARDEN_MODE`` first, for every
    guard and the capacity gate); an unknown name or value raises ConfigError."""
    env = os.environ if environ is None else environ
    check_setting_names(env)
    defaults = HardenConfig()
    values: dict[str, object] = {}
    mode = rollout_mode(env)
    for f in fields(HardenConfig):
        if f.name == "extra":
            continue
        raw = env.get(ENV_PREFIX + f.name.upper())
        if raw is not None:
            values[f.name] = _parse_field(f.name, raw, getattr(defaults, f.name))
        elif mode is not None and isinstance(getattr(defaults, f.name), (Mode, CapacityMode)):
            values[f.name] = type(getattr(defaults, f.name))(mode.value)
    config = HardenConfig(**values)
    _warn_disabled(config)
    return config


def bootstrap_auth_requested(environ: dict[str, str] | None = None) -> bool:
    """The operator set ``bootstrap_auth`` to enforce explicitly (without a secret file that is an error)."""
    env = os.environ if environ is None else environ
    return env.get(ENV_PREFIX + "BOOTSTRAP_AUTH", "").strip().lower() == Mode.ENFORCE.value


def _warn_disabled(config: HardenConfig) -> None:
    for guard in GUARDS:
        if guard in ("bootstrap_auth", "zmq_auth") and not config.bootstrap_secret_file:
            continue  # not armed without a secret: the start-up warning says so once
        if config.mode(guard) is not Mode.ENFORCE:
            logger.warning("sglang-harden guard %s is in %s mode", guard, config.mode(guard).value)
    if config.capacity is not CapacityMode.ENFORCE:
        logger.warning("sglang-harden capacity gate is in %s mode", config.capacity.value)


def flag_to_env(flag: str, value: str) -> tuple[str, str]:
    """``--harden-page-tags log`` -> (``SGLANG_HARDEN_PAGE_TAGS``, ``log``)."""
    name = flag.removeprefix("--harden-").replace("-", "_")
    known = {f.name for f in fields(HardenConfig)} - {"extra"}
    if name not in known:
        raise ConfigError(f"unknown option {flag}; known: " + ", ".join(sorted(known)))
    _parse_field(name, value, getattr(HardenConfig(), name))
    return ENV_PREFIX + name.upper(), value
