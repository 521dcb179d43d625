"""The plugin's control-plane keys in one process (``compat/control_auth.py``, ``compat/control_keys.py``): the secret
file at start-up and re-read, the listed authorities, the client's answer check in each mode."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sglang_harden import events
from sglang_harden.compat import control_auth, control_keys
from sglang_harden.compat.runtime import HardenRefusal
from sglang_harden.config import HardenConfig, Mode
from sglang_harden.guards import bootstrap_auth

GOOD = "g" * 40


def _secret(path: Path, content: bytes) -> str:
    path.write_bytes(content)
    path.chmod(0o600)
    return str(path)


def test_a_secret_file_that_is_not_utf8_refuses_to_start(tmp_path: Path) -> None:
    """Issue 39: it raised UnicodeDecodeError (not a clear refusal)."""
    path = _secret(tmp_path / "secret", b"\xff" * 40 + b"\n")
    with pytest.raises(HardenRefusal, match="not UTF-8"):
        control_auth.load(HardenConfig(bootstrap_secret_file=path))


def test_a_secret_file_edited_into_invalid_utf8_keeps_the_last_good_secrets(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    """Issue 39: every control request answered 500 (UnicodeDecodeError on each re-read)."""
    path = _secret(tmp_path / "secret", GOOD.encode() + b"\n")
    auth = control_auth.load(HardenConfig(bootstrap_secret_file=path))
    assert auth is not None
    monkeypatch.setattr(control_keys, "RELOAD_EVERY_S", 0.0)
    Path(path).write_bytes(b"\xfe" * 50 + b"\n")
    os.utime(path, ns=(1, 1))
    with caplog.at_level("ERROR", logger="sglang_harden"):
        assert auth.refreshed().signing == GOOD.encode()
    assert "not UTF-8" in caplog.text and "keeping the last good secrets" in caplog.text
    token = auth.headers("GET", "127.0.0.1:8998", "/route", b"")[bootstrap_auth.HEADER]
    decision = bootstrap_auth.verify(auth.refreshed(), bootstrap_auth.RequestHead("GET", "127.0.0.1:8998", "/route"),
                                     b"", token, auth.nonces, identity=bootstrap_auth.ServerIdentity(8998,
                                                                                                     frozenset({"127.0.0.1"})))
    assert decision.allows, decision.reason
    Path(path).write_text("n" * 40 + "\n")
    os.utime(path, ns=(2, 2))
    assert auth.refreshed().signing == b"n" * 40, "a good edit after a bad one is picked up"


def test_listed_authorities_are_checked_at_start(tmp_path: Path) -> None:
    path = _secret(tmp_path / "secret", GOOD.encode())
    with pytest.raises(HardenRefusal, match="host:port"):
        control_auth.load(HardenConfig(bootstrap_secret_file=path, bootstrap_authorities="prefill.svc"))
    auth = control_auth.load(HardenConfig(bootstrap_secret_file=path, bootstrap_authorities="Prefill.svc:8998"))
    assert auth is not None and auth.listed == frozenset({"prefill.svc:8998"})


@pytest.mark.parametrize("mode", [Mode.ENFORCE, Mode.LOG])
def test_an_unsigned_answer_is_refused_in_enforce_and_counted_in_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    mode: Mode) -> None:
    import dataclasses

    from sglang_harden.compat.runtime import RUNTIME

    path = _secret(tmp_path / f"secret-{mode.value}", GOOD.encode())
    monkeypatch.setattr(RUNTIME, "config", dataclasses.replace(RUNTIME.config, bootstrap_auth=mode))
    auth = control_auth.load(HardenConfig(bootstrap_secret_file=path))
    assert auth is not None
    sent = auth.headers("GET", "127.0.0.1:8998", "/route", b"")
    before = events.snapshot()
    refusal = auth.answer_refusal(sent, 200, {}, b'{"rank_ip": "6.6.6.6"}', url="127.0.0.1:8998/route")
    label = "reject" if mode is Mode.ENFORCE else "reject_logged"
    assert events.snapshot().get(f"bootstrap_auth:{label}", 0) == before.get(f"bootstrap_auth:{label}", 0) + 1
    assert (refusal is not None) is (mode is Mode.ENFORCE)
    assert auth.answer_refusal({}, 200, {}, b"", url="x") is None, "an unsigned request: nothing to hold it to"
    token = bootstrap_auth.read_token(sent[bootstrap_auth.HEADER])
    assert token is not None
    signed = {bootstrap_auth.ANSWER_HEADER: bootstrap_auth.sign_answer(auth.refreshed(), token, 200, b"{}")}
    assert auth.answer_refusal(sent, 200, signed, b"{}", url="x") is None
    assert auth.headers("GET", "127.0.0.1:8998", "/health", b"") == {}, "open paths go unsigned"
