"""The control-plane token: sign/verify, replay cache, rotation, secret file parsing (pure logic)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_harden.guards.base import Verdict
from sglang_harden.guards.bootstrap_auth import (
    MIN_SECRET_CHARS,
    Keyring,
    NonceCache,
    SecretFileError,
    parse_secrets,
    sign,
    verify,
)

OLD = "o" * MIN_SECRET_CHARS
NEW = "n" * MIN_SECRET_CHARS
KEYS = parse_secrets(OLD)
BODY = b'{"bootstrap_room": 7}'
TARGET = "/route?engine_rank=0&target_dp_group=0"


def _check(token: str | None, keyring: Keyring = KEYS, method: str = "PUT", target: str = TARGET,
           body: bytes = BODY, now: float = 1010, nonces: NonceCache | None = None) -> Verdict:
    return verify(keyring, method, target, body, token, nonces or NonceCache(120), max_age_s=60, now=now).verdict


def test_valid_token_passes_once() -> None:
    token = sign(KEYS, "PUT", TARGET, BODY, now=1000)
    nonces = NonceCache(120)
    assert _check(token, nonces=nonces) is Verdict.ALLOW
    assert _check(token, nonces=nonces) is Verdict.REJECT, "a replay inside the window is refused"


def test_every_bound_field_matters() -> None:
    token = sign(KEYS, "PUT", TARGET, BODY, now=1000)
    assert _check(token, method="POST") is Verdict.REJECT
    assert _check(token, target="/route?engine_rank=1&target_dp_group=0") is Verdict.REJECT
    assert _check(token, body=b'{"bootstrap_room": 8}') is Verdict.REJECT
    assert _check(token, keyring=parse_secrets(NEW)) is Verdict.REJECT
    assert _check(token, now=1061) is Verdict.REJECT, "too old"
    assert _check(token, now=939) is Verdict.REJECT, "from too far in the future"
    stamp, rest = token.split(".", 2)[1], token.split(".", 2)[2]
    assert _check(f"sgh1.{int(stamp) + 1}.{rest}") is Verdict.REJECT, "the timestamp is signed"


@pytest.mark.parametrize("token", [None, "", "garbage", "sgh1.1000.x.y", "v1.1000.abc", "sgh1.-5." + "a" * 32
                                   + "." + "b" * 64, "sgh1.1000." + "a" * 32 + "." + "b" * 64, "x" * 5000])
def test_missing_and_malformed_are_401(token: str | None) -> None:
    decision = verify(KEYS, "PUT", TARGET, BODY, token, NonceCache(120), max_age_s=60, now=1000)
    assert decision.verdict is Verdict.REJECT and decision.status_code == 401
    assert token is None or not token or token not in decision.reason


def test_rotation_accepts_both_secrets_and_signs_with_the_first() -> None:
    both = parse_secrets(f"{NEW}\n{OLD}\n")
    old_only, new_only = parse_secrets(OLD), parse_secrets(NEW)
    assert _check(sign(old_only, "GET", TARGET, b"", now=1000), keyring=both, method="GET", body=b"") \
        is Verdict.ALLOW, "a node not yet rotated is still accepted"
    token = sign(both, "GET", TARGET, b"", now=1000)
    assert _check(token, keyring=new_only, method="GET", body=b"") is Verdict.ALLOW, "signed with the new one"
    assert _check(token, keyring=old_only, method="GET", body=b"") is Verdict.REJECT


def test_secret_file_errors_never_quote_the_secret() -> None:
    short = "tooshort"
    with pytest.raises(SecretFileError) as err:
        parse_secrets(short)
    assert short not in str(err.value)
    with pytest.raises(SecretFileError):
        parse_secrets("# only a comment\n\n")
    with pytest.raises(SecretFileError):
        parse_secrets(f"{OLD}\n{NEW}\n{'x' * 40}")
    assert "o" * MIN_SECRET_CHARS not in repr(KEYS)


def test_nonce_cache_forgets_after_the_window_and_refuses_when_full() -> None:
    cache = NonceCache(window_s=10, max_entries=2)
    assert cache.first_use("a", now=0) is True
    assert cache.first_use("a", now=5) is False
    assert cache.first_use("b", now=6) is True
    assert cache.first_use("c", now=7) is None, "full of live nonces: undecidable, so refused"
    assert cache.first_use("c", now=10.5) is True, "'a' expired and made room"
    assert cache.first_use("a", now=10.6) is None, "still full (b, c)"
    assert cache.first_use("a", now=16.1) is True, "'b' expired: 'a' is new again, its token long expired"
    assert cache.size() == 2


@settings(max_examples=300, deadline=None)
@given(method=st.sampled_from(["GET", "PUT", "POST"]), target=st.text(max_size=80), body=st.binary(max_size=512),
       flip=st.integers(min_value=0, max_value=63))
def test_any_changed_mac_character_is_refused(method: str, target: str, body: bytes, flip: int) -> None:
    token = sign(KEYS, method, target, body, now=1000)
    head, mac = token.rsplit(".", 1)
    changed = mac[:flip] + ("0" if mac[flip] != "0" else "1") + mac[flip + 1:]
    assert _check(token, method=method, target=target, body=body) is Verdict.ALLOW
    assert _check(f"{head}.{changed}", method=method, target=target, body=body) is Verdict.REJECT
