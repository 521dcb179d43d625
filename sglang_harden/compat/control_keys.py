"""The control plane's secrets and checks in one SGLang process, for the plugin (``control_auth``) and the backport
series alike (``pd_auth`` bundles this module): the secret file, re-read when it changes; the replay cache; the
token of each request a client sends; and the client's check of the answer. The token rules are
``guards/bootstrap_auth.py``. What becomes of a refusal (counted, logged, applied in the guard's mode) is the
caller's ``report``. Standard library only.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from sglang_harden.guards.base import Decision
from sglang_harden.guards.bootstrap_auth import (
    ANSWER_HEADER,
    DEFAULT_MAX_NONCES,
    HEADER,
    OPEN_PATHS,
    Keyring,
    NonceCache,
    SecretFileError,
    check_answer,
    parse_secret_bytes,
    sign,
)

logger = logging.getLogger("sglang_harden")

RELOAD_EVERY_S = 1.0
# (decision, what it is about: method, path, remote or url) -> apply it (True only for a refusal in enforce mode)
Report = Callable[[Decision, Mapping[str, object]], bool]


def _stamp(path: str) -> tuple[int, int]:
    info = os.stat(path)
    return info.st_mtime_ns, info.st_size


class SecretFile:
    """The keyring of a secret file. Read at once (SecretFileError when it cannot be used: unreadable, not UTF-8,
    not valid), then re-read at most once a second when its size or mtime changed; an edit that made it
    unreadable or invalid keeps the last good keyring and logs an error, so authentication never switches off."""

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self._stamp = _stamp(path)
            with open(path, "rb") as handle:
                self._keyring = parse_secret_bytes(handle.read())
            mode = os.stat(path).st_mode
        except OSError as exc:
            raise SecretFileError(f"cannot read the bootstrap secret file {path}: {exc.strerror or exc}") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            logger.warning("sglang-harden: the bootstrap secret file %s is readable by group or others (mode %o); "
                           "chmod 600 it", path, stat.S_IMODE(mode))
        self._checked_at = time.monotonic()
        self._lock = threading.Lock()

    def keyring(self) -> Keyring:
        now = time.monotonic()
        if now - self._checked_at < RELOAD_EVERY_S:
            return self._keyring
        with self._lock:
            self._checked_at = now
            try:
                stamp = _stamp(self.path)
                if stamp != self._stamp:
                    with open(self.path, "rb") as handle:
                        self._keyring, self._stamp = parse_secret_bytes(handle.read()), stamp
                    logger.warning("sglang-harden: bootstrap secret file %s re-read (%d secret(s) accepted)",
                                   self.path, len(self._keyring.accepted))
            except (OSError, SecretFileError) as exc:
                logger.error("sglang-harden: bootstrap secret file %s unusable (%s); keeping the last good secrets",
                             self.path, exc)
            return self._keyring


class ControlKeys:
    """One process's control-plane authentication: its secrets, its replay cache and its settings."""

    def __init__(self, secrets: SecretFile, report: Report, *, max_age_s: float, accept_sgh1: bool = False,
                 listed: frozenset[str] = frozenset(), max_nonces: int = DEFAULT_MAX_NONCES) -> None:
        self.secrets = secrets
        self.report = report
        self.max_age_s = max_age_s
        self.accept_sgh1 = accept_sgh1
        self.listed = listed
        self.nonces = NonceCache(max_age_s, max_nonces)

    def refreshed(self) -> Keyring:
        return self.secrets.keyring()

    def headers(self, method: str, authority: str, target: str, body: bytes | str | None) -> dict[str, str]:
        """The token header of one request to the bootstrap server at ``authority`` (none for an open path)."""
        if target.partition("?")[0] in OPEN_PATHS:
            return {}
        return {HEADER: sign(self.refreshed(), method, authority, target, body)}

    def answer_refusal(self, sent: Mapping[str, str], status: int, answer: Mapping[str, Any], body: bytes,
                       **about: object) -> str | None:
        """None when the client may use the answer to the request it sent with headers ``sent``; else why not
        (reported; in log mode the answer is used and None returned)."""
        token = sent.get(HEADER)
        if not token:
            return None  # an unsigned request (no secret here, or an open path): nothing to hold the answer to
        decision = check_answer(self.refreshed(), token, status, answer.get(ANSWER_HEADER), body)
        if decision.allows or not self.report(decision, about):
            return None
        return decision.reason


class CurrentSigner:
    """A signer for clients made before the process knows whether it has a secret: asks ``source`` at each
    request (None: requests go unsigned and answers unchecked)."""

    def __init__(self, source: Callable[[], ControlKeys | None]) -> None:
        self._source = source

    def headers(self, method: str, authority: str, target: str, body: bytes | str | None) -> dict[str, str]:
        keys = self._source()
        return keys.headers(method, authority, target, body) if keys is not None else {}

    def answer_refusal(self, sent: Mapping[str, str], status: int, answer: Mapping[str, Any], body: bytes,
                       **about: object) -> str | None:
        keys = self._source()
        return keys.answer_refusal(sent, status, answer, body, **about) if keys is not None else None
