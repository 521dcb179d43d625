"""Per-process state of an activated sglang-harden: configuration, pin, and the abort and digest side channels."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sglang_harden import __version__, events
from sglang_harden.compat import digest_channel, notify
from sglang_harden.config import HardenConfig, load_config
from sglang_harden.guards import bootstrap_auth, canary, checksum, coverage, page_tags, zmq_auth
from sglang_harden.guards.base import Decision, Verdict

logger = logging.getLogger("sglang_harden")

# The decisions the fleet's alert rules watch (deploy/prometheus/): each armed guard's sample exists from start-up,
# at 0, so that its first occurrence is an increase Prometheus can see.
WATCHED_DECISIONS = {
    checksum.GUARD: Verdict.ABORT, canary.GUARD: Verdict.ABORT, page_tags.GUARD: Verdict.ABORT,
    coverage.GUARD: Verdict.ABORT, bootstrap_auth.GUARD: Verdict.REJECT, zmq_auth.GUARD: Verdict.REJECT,
}


class HardenRefusal(RuntimeError):
    """sglang-harden refuses to let this process serve (missing hook, unsafe configuration)."""


@dataclass
class Runtime:
    config: HardenConfig = field(default_factory=HardenConfig)
    pin: str = "unknown"
    family: str = "unknown"
    source: str = ""
    armed: tuple[str, ...] = ()
    publisher: notify.Publisher | None = None
    digest_publisher: digest_channel.DigestPublisher | None = None
    watcher: notify.DecodeWatcher | None = None
    feed: digest_channel.DigestFeed | None = None
    # decode's tokenizer process: answers a client whose request prefill refused, without the scheduler
    front_answer_watcher: notify.DecodeWatcher | None = None
    # Decode's KV pool (set at its scheduler's start-up), where the canary stamps pages.
    decode_kv_pool: Any = None
    # The KV shapes this scheduler serves and each armed guard's coverage of them (compat/model_shape.py).
    model_shape: dict[str, Any] = field(default_factory=dict)
    # Set by the lifecycle adapter on decode: prefill said it never queued a write for (room, bootstrap addr).
    writer_never_started: Callable[[int, str], None] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def configure(self, pin: str, family: str, source: str) -> None:
        self.config = load_config()
        self.pin, self.family, self.source = pin, family, source
        if self.config.checksum.value != "off":
            threading.Thread(target=_prepare_digest_kernel, name="sglang-harden-digest-build", daemon=True).start()
        if self.config.lifecycle.value != "off":
            threading.Thread(target=_prepare_ledger_kernel, name="sglang-harden-ledger-build", daemon=True).start()

    def start_publisher(self, base_url: str) -> None:
        with self._lock:
            if self.publisher is None:
                self.publisher = notify.Publisher(base_url)
            if self.digest_publisher is None and self.config.checksum.value != "off":
                self.digest_publisher = digest_channel.DigestPublisher(base_url)

    def decode_watcher(self, on_abort: Callable[[object, notify.PeerAbort], None]) -> notify.DecodeWatcher | None:
        if self.config.abort_notify.value == "off":
            return None
        with self._lock:
            if self.watcher is None:
                self.watcher = notify.DecodeWatcher(on_abort)
            return self.watcher

    def front_watcher(self, on_abort: Callable[[object, notify.PeerAbort], None],
                      concluded: Callable[[object], bool]) -> notify.DecodeWatcher | None:
        """Decode's tokenizer-process watcher (made on first use), or None with abort_notify off."""
        if self.config.abort_notify.value == "off":
            return None
        with self._lock:
            if self.front_answer_watcher is None:
                self.front_answer_watcher = notify.DecodeWatcher(on_abort, concluded,
                                                                 name="sglang-harden-front-watcher")
            return self.front_answer_watcher

    def digest_feed(self) -> digest_channel.DigestFeed | None:
        """Decode's reader of prefill digest feeds (made on first use), or None with the checksum guard off."""
        if self.config.checksum.value == "off":
            return None
        with self._lock:
            if self.feed is None:
                self.feed = digest_channel.DigestFeed()
            return self.feed

    def mode_summary(self) -> str:
        """``enforce`` or ``log`` when every armed guard is in that mode, else ``mixed`` (``none``: none armed)."""
        modes = {self.config.mode(guard).value for guard in self.armed}
        return modes.pop() if len(modes) == 1 else ("none" if not modes else "mixed")

    def log_active(self, role: str) -> None:
        """The start-up line, ``sglang_harden_build_info`` on ``/metrics`` and the watched decisions' samples at 0."""
        mode = self.mode_summary()
        logger.warning(
            "sglang-harden active: pin=%s family=%s role=%s pid=%s via=%s guards=%s capacity=%s mode=%s version=%s",
            self.pin, self.family, role, os.getpid(), self.source, ",".join(self.armed), self.config.capacity.value,
            mode, __version__,
        )
        events.publish_build_info(version=__version__, pin=self.pin, family=self.family, role=role, mode=mode)
        for guard in self.armed:
            if guard in WATCHED_DECISIONS:
                events.prime(Decision(guard, WATCHED_DECISIONS[guard]), self.config.mode(guard))


def _prepare_digest_kernel() -> None:
    """Build (or load) the native digest now, off the scheduler thread, rather than on the first request."""
    from sglang_harden.kernels.digest_native import native_status

    built, detail = native_status()
    _log_kernel("checksum digest on CPU tensors", "native" if built else "torch", built, detail)


def _prepare_ledger_kernel() -> None:
    """Build (or load) the native page-ledger paths now, off the scheduler thread, rather than on the first
    transfer (until then the ledger runs its numpy path)."""
    from sglang_harden.kernels.ledger_native import native_status

    built, detail = native_status()
    _log_kernel("page ledger", "native" if built else "numpy", built, detail)


def _log_kernel(what: str, path: str, built: bool, detail: str) -> None:
    """A library that is not switched off and could not be built is a warning (``sglang-harden build-kernels`` at
    image build time avoids it)."""
    level = logging.INFO if built or detail.startswith("disabled by") else logging.WARNING
    hint = "" if level == logging.INFO else "; run `sglang-harden build-kernels` when building the image"
    logger.log(level, "sglang-harden %s: %s (%s%s)", what, path, detail, hint)


RUNTIME = Runtime()
