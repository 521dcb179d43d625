"""The control-plane token: sign/verify, Host binding, signed answers, replay cache, rotation, secret file parsing
(pure logic)."""

from __future__ import annotations

import hashlib
import hmac

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_harden.guards.base import Verdict
from sglang_harden.guards.bootstrap_auth import (
    ANSWER_HEADER,
    MIN_SECRET_CHARS,
    Keyring,
    NonceCache,
    RequestHead,
    SecretFileError,
    ServerIdentity,
    canonical_authority,
    check_answer,
    check_body,
    check_head,
    parse_listed,
    parse_secret_bytes,
    parse_secrets,
    read_token,
    sign,
    sign_answer,
    verify,
)

OLD = "o" * MIN_SECRET_CHARS
NEW = "n" * MIN_SECRET_CHARS
KEYS = parse_secrets(OLD)
BODY = b'{"bootstrap_room": 7}'
TARGET = "/route?engine_rank=0&target_dp_group=0"
HOST = "10.0.0.1:8998"
HERE = ServerIdentity(8998, frozenset({"10.0.0.1"}))


def _check(token: str | None, keyring: Keyring = KEYS, method: str = "PUT", target: str = TARGET,
           body: bytes = BODY, now: float = 1010, nonces: NonceCache | None = None, host: str | None = HOST,
           identity: ServerIdentity = HERE, local: str | None = None, accept_sgh1: bool = False) -> Verdict:
    head = RequestHead(method, host, target, local)
    return verify(keyring, head, body, token, nonces or NonceCache(60), identity=identity, max_age_s=60, now=now,
                  accept_sgh1=accept_sgh1).verdict


def _legacy(keyring: Keyring, method: str, target: str, body: bytes, now: int, nonce: str = "c" * 32) -> str:
    """An sgh1 token as sglang-harden signed before issue 39 (no Host, the body only inside the MAC)."""
    digest = hashlib.sha256(body).hexdigest()
    message = f"sgh1\n{method}\n{target}\n{digest}\n{now}\n{nonce}".encode()
    return f"sgh1.{now}.{nonce}.{hmac.new(keyring.signing, message, hashlib.sha256).hexdigest()}"


def test_valid_token_passes_once() -> None:
    token = sign(KEYS, "PUT", HOST, TARGET, BODY, now=1000)
    nonces = NonceCache(60)
    assert _check(token, nonces=nonces) is Verdict.ALLOW
    assert _check(token, nonces=nonces) is Verdict.REJECT, "a replay inside the window is refused"


def test_every_bound_field_matters() -> None:
    token = sign(KEYS, "PUT", HOST, TARGET, BODY, now=1000)
    assert _check(token, method="POST") is Verdict.REJECT
    assert _check(token, target="/route?engine_rank=1&target_dp_group=0") is Verdict.REJECT
    assert _check(token, body=b'{"bootstrap_room": 8}') is Verdict.REJECT
    assert _check(token, keyring=parse_secrets(NEW)) is Verdict.REJECT
    assert _check(token, now=1061) is Verdict.REJECT, "too old"
    assert _check(token, now=939) is Verdict.REJECT, "from too far in the future"
    stamp, rest = token.split(".", 2)[1], token.split(".", 2)[2]
    assert _check(f"sgh2.{int(stamp) + 1}.{rest}") is Verdict.REJECT, "the timestamp is signed"
    head, mac = token.rsplit(".", 1)
    other_digest = hashlib.sha256(b"{}").hexdigest()
    assert _check(".".join(head.split(".")[:3] + [other_digest, mac]), body=b"{}") is Verdict.REJECT, \
        "the body hash is signed"


def test_the_host_is_bound_and_must_name_this_server() -> None:
    """Issue 39: a signed PUT /route for one prefill's bootstrap server cannot be replayed to another one."""
    token = sign(KEYS, "PUT", HOST, TARGET, BODY, now=1000)
    other = ServerIdentity(8998, frozenset({"10.0.0.2"}))
    assert _check(token, host="10.0.0.2:8998", identity=other) is Verdict.REJECT, "the MAC covers the Host"
    assert _check(token, identity=other) is Verdict.REJECT, "the Host it was made for does not name the other one"
    assert _check(token, identity=other, local="10.0.0.2") is Verdict.REJECT
    assert _check(token, identity=ServerIdentity(8999, frozenset({"10.0.0.1"}))) is Verdict.REJECT, "other port"
    assert _check(token, host=None) is Verdict.REJECT, "no (or a repeated) Host header"
    assert _check(token, identity=ServerIdentity(8998), local="10.0.0.1") is Verdict.ALLOW, \
        "the address the connection arrived on names the server"
    assert _check(token, host="10.0.0.1") is Verdict.REJECT, "port 80 is another authority"


def test_the_host_is_compared_in_canonical_form() -> None:
    token = sign(KEYS, "GET", "Prefill-0.PD.svc:8998", "/route", b"", now=1000)
    identity = ServerIdentity(8998, frozenset({"prefill-0.pd.svc"}))
    assert _check(token, method="GET", target="/route", body=b"", host="prefill-0.pd.svc:8998",
                  identity=identity) is Verdict.ALLOW
    v6 = sign(KEYS, "GET", "[0:0::1]:8998", "/route", b"", now=1000)
    assert _check(v6, method="GET", target="/route", body=b"", host="[::1]:8998",
                  identity=ServerIdentity(8998, frozenset({"::1"}))) is Verdict.ALLOW
    local = sign(KEYS, "GET", "localhost:8998", "/route", b"", now=1000)
    assert _check(local, method="GET", target="/route", body=b"", host="localhost:8998",
                  identity=ServerIdentity(8998), local="::ffff:127.0.0.1") is Verdict.ALLOW
    assert _check(local, method="GET", target="/route", body=b"", host="localhost:8998",
                  identity=ServerIdentity(8998), local="10.0.0.1") is Verdict.REJECT, "localhost only on loopback"
    wildcard = sign(KEYS, "PUT", "0.0.0.0:8998", "/route", BODY, now=1000)  # 0.5.10 prefill registering itself
    assert _check(wildcard, target="/route", host="0.0.0.0:8998", identity=ServerIdentity(8998),
                  local="127.0.0.1") is Verdict.ALLOW
    assert _check(wildcard, target="/route", host="0.0.0.0:8998", identity=ServerIdentity(8998),
                  local="10.0.0.1") is Verdict.REJECT


@pytest.mark.parametrize("text,expected", [
    ("a.b:80", "a.b:80"), ("A.B", "a.b:80"), ("[::1]:9", "[::1]:9"), ("[0::1]", "[::1]:80"), ("1.2.3.4:65535",
                                                                                             "1.2.3.4:65535"),
    ("[::ffff:1.2.3.4]:5", "1.2.3.4:5"), ("::1", None), ("a:b", None), ("a:0", None), ("a:65536", None),
    ("a:", None), ("", None), (None, None), ("a b:1", None), ("a@b:1", None), ("é:1", None), ("a:¹", None),
    ("[a]:1", None), ("[::1]x", None), ("a:1:2", None)])
def test_canonical_authority(text: str | None, expected: str | None) -> None:
    assert canonical_authority(text) == expected


def test_listed_authorities() -> None:
    listed = parse_listed(" Prefill.svc:8998, *:9000 ,[::1]:1,")
    assert listed == frozenset({"prefill.svc:8998", "*:9000", "[::1]:1"})
    identity = ServerIdentity(8998, frozenset({"10.0.0.1"}), listed)
    assert identity.names("prefill.svc:8998") and identity.names("anything:9000")
    assert not identity.names("prefill.svc:9001") and not identity.names("other:8998")
    assert ServerIdentity(None, listed=parse_listed("*")).names("x:1")
    for bad in ("prefill.svc", "a:b", "*:x", "[::1]"):
        with pytest.raises(ValueError, match="host:port"):
            parse_listed(bad)


@pytest.mark.parametrize("token", [None, "", "garbage", "sgh2.1000.x.y.z", "v1.1000.abc", "sgh2.-5." + "a" * 32
                                   + "." + "b" * 64 + "." + "c" * 64, "sgh2.1000." + "A" * 32 + "." + "b" * 64 + "."
                                   + "c" * 64, "sgh1.1000." + "a" * 32 + "." + "b" * 64, "x" * 5000])
def test_missing_and_malformed_are_401(token: str | None) -> None:
    decision = verify(KEYS, RequestHead("PUT", HOST, TARGET), BODY, token, NonceCache(60), identity=HERE,
                      max_age_s=60, now=1000)
    assert decision.verdict is Verdict.REJECT and decision.status_code == 401
    assert token is None or not token or token not in decision.reason


@pytest.mark.parametrize("stamp", ["²", "1000²", "١٠٠٠", "１０００"])
def test_non_ascii_digits_in_the_timestamp_are_malformed(stamp: str) -> None:
    """Issue 39: ``"²".isdigit()`` is True and ``int("²")`` raises (a 500); ``int("١٠٠٠")`` is 1000."""
    for token in (f"sgh2.{stamp}.{'a' * 32}.{'b' * 64}.{'c' * 64}", f"sgh1.{stamp}.{'a' * 32}.{'b' * 64}"):
        decision = verify(KEYS, RequestHead("PUT", HOST, TARGET), BODY, token, NonceCache(60), identity=HERE,
                          max_age_s=60, now=1000, accept_sgh1=True)
        assert decision.verdict is Verdict.REJECT and decision.status_code == 401
        assert "malformed" in decision.reason


def test_a_valid_token_with_its_timestamp_in_other_digits_is_refused() -> None:
    token = sign(KEYS, "PUT", HOST, TARGET, BODY, now=1000)
    version, stamp, rest = token.split(".", 2)
    arabic = stamp.translate(str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩"))
    assert _check(token) is Verdict.ALLOW
    assert _check(f"{version}.{arabic}.{rest}") is Verdict.REJECT


def test_the_head_is_decided_before_the_body() -> None:
    """Everything but the body hash is decided from the head; the nonce is spent there, so a captured token
    cannot open a second body."""
    head = RequestHead("PUT", HOST, TARGET)
    nonces = NonceCache(60)
    forged = sign(parse_secrets(NEW), "PUT", HOST, TARGET, BODY, now=1000)
    decision, token = check_head(KEYS, head, forged, nonces, identity=HERE, max_age_s=60, now=1000)
    assert decision.verdict is Verdict.REJECT and token is None
    good = sign(KEYS, "PUT", HOST, TARGET, BODY, now=1000)
    decision, token = check_head(KEYS, head, good, nonces, identity=HERE, max_age_s=60, now=1000)
    assert decision.allows and token is not None
    assert check_head(KEYS, head, good, nonces, identity=HERE, max_age_s=60, now=1000)[0].verdict is Verdict.REJECT
    assert check_body(KEYS, head, token, b'{"bootstrap_room": 8}', nonces, now=1000).verdict is Verdict.REJECT
    assert check_body(KEYS, head, token, BODY, nonces, now=1000).allows


def test_sgh1_tokens_only_while_accepted() -> None:
    """A signer from before issue 39: refused, unless the verifier accepts sgh1 for a rollout (then the old
    rules: the MAC with the body, the nonce once)."""
    old = _legacy(KEYS, "PUT", TARGET, BODY, 1000)
    decision = verify(KEYS, RequestHead("PUT", HOST, TARGET), BODY, old, NonceCache(60), identity=HERE,
                      max_age_s=60, now=1000)
    assert decision.verdict is Verdict.REJECT and "ACCEPT_SGH1" in decision.reason
    nonces = NonceCache(60)
    assert _check(old, nonces=nonces, accept_sgh1=True) is Verdict.ALLOW
    assert _check(old, nonces=nonces, accept_sgh1=True) is Verdict.REJECT, "replayed"
    assert _check(_legacy(KEYS, "PUT", TARGET, BODY, 1000, "d" * 32), body=b"{}", accept_sgh1=True) \
        is Verdict.REJECT


def test_answers_are_signed_for_their_request() -> None:
    """Issue 39: decode trusts prefill's /route answer (the ranks it connects to): only if signed for its request."""
    sent = sign(KEYS, "GET", HOST, TARGET, b"", now=1000)
    token = read_token(sent)
    assert token is not None
    body = b'{"rank_ip": "10.0.0.1", "rank_port": 17000}'
    signed = sign_answer(KEYS, token, 200, body)
    assert check_answer(KEYS, sent, 200, signed, body).allows
    assert check_answer(parse_secrets(f"{NEW}\n{OLD}"), sent, 200, signed, body).allows, "rotation"
    forged = b'{"rank_ip": "6.6.6.6", "rank_port": 6666}'
    for status, answer, content in ((200, None, body), (200, signed, forged), (201, signed, body),
                                    (200, sign_answer(parse_secrets(NEW), token, 200, body), body),
                                    (200, sign_answer(KEYS, read_token(sign(KEYS, "GET", HOST, TARGET, b"")), 200,
                                                      body), body), (302, None, b"")):
        decision = check_answer(KEYS, sent, status, answer, content)
        assert decision.verdict is Verdict.REJECT and decision.status_code == 502, (status, answer)
    assert check_answer(KEYS, sent, 401, None, b"refused").allows, "an error needs no signature"
    assert ANSWER_HEADER == "X-SGLang-Harden-Answer"


def test_rotation_accepts_both_secrets_and_signs_with_the_first() -> None:
    both = parse_secrets(f"{NEW}\n{OLD}\n")
    old_only, new_only = parse_secrets(OLD), parse_secrets(NEW)
    assert _check(sign(old_only, "GET", HOST, TARGET, b"", now=1000), keyring=both, method="GET", body=b"") \
        is Verdict.ALLOW, "a node not yet rotated is still accepted"
    token = sign(both, "GET", HOST, TARGET, b"", now=1000)
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
    with pytest.raises(SecretFileError, match="not UTF-8"):
        parse_secret_bytes(b"\xff" * 40)
    assert parse_secret_bytes(OLD.encode()) == KEYS


def test_nonce_cache_forgets_after_the_tokens_validity() -> None:
    cache = NonceCache(max_age_s=10, max_entries=10)
    assert cache.first_use(100, "a", now=100) is True
    assert cache.first_use(100, "a", now=110) is False, "still acceptable at ts + max_age"
    assert cache.first_use(100, "b", now=105) is True
    assert cache.first_use(101, "a", now=105) is True, "another second: another token"
    assert cache.size() == 3
    assert cache.first_use(100, "a", now=110.5) is None, "second 100 forgotten: its tokens are refused"
    assert cache.size() == 1


def test_at_the_cap_fresh_tokens_are_still_served() -> None:
    """Issue 39: the cap used to refuse every request until the window passed. Now the oldest second is forgotten
    and only tokens that old (or older) are refused."""
    nonces = NonceCache(60, max_entries=3)
    old = [sign(KEYS, "PUT", HOST, TARGET, BODY, now=1000) for _ in range(3)]
    for token in old:
        assert _check(token, now=1000, nonces=nonces) is Verdict.ALLOW
    assert _check(sign(KEYS, "PUT", HOST, TARGET, BODY, now=1001), now=1001, nonces=nonces) is Verdict.ALLOW
    assert nonces.size() == 1 and nonces.floor == 1000
    for token in old:
        assert _check(token, now=1001, nonces=nonces) is Verdict.REJECT, "a forgotten nonce is never replayable"
    assert _check(sign(KEYS, "PUT", HOST, TARGET, BODY, now=1000), now=1001, nonces=nonces) is Verdict.REJECT, \
        "a new token of a forgotten second: a replay could not be told apart"
    for second in range(1002, 1012):  # a sustained flood: a token a second is always served
        assert _check(sign(KEYS, "PUT", HOST, TARGET, BODY, now=second), now=second, nonces=nonces) is Verdict.ALLOW
        assert nonces.size() <= 3


def test_nonce_cache_flooded_within_one_second_recovers_the_next() -> None:
    cache = NonceCache(60, max_entries=2)
    assert cache.first_use(1000, "a", 1000) and cache.first_use(1000, "b", 1000)
    assert cache.first_use(1000, "c", 1000) is None, "its own second had to go: refused"
    assert cache.first_use(1000, "a", 1000) is None, "and 'a' stays refused"
    assert cache.first_use(1001, "d", 1001) is True


def test_nonce_cache_survives_a_clock_that_steps_back() -> None:
    cache = NonceCache(10, max_entries=100)
    assert cache.first_use(100, "a", now=100) is True
    assert cache.first_use(200, "b", now=200) is True  # second 100 expired and forgotten
    assert cache.first_use(100, "a", now=105) is None, "the clock went back: the forgotten token stays refused"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.sampled_from("abcdef"), st.integers(0, 3)), max_size=80),
       st.integers(1, 6))
def test_nonce_cache_never_admits_a_token_twice(uses: list[tuple[int, str, int]], cap: int) -> None:
    """Whatever the order, the cap and the clock's wandering: a (second, nonce) the cache admitted once is never
    admitted again while it is acceptable, and the cache holds at most ``cap`` nonces."""
    cache, admitted, clock = NonceCache(5, max_entries=cap), set(), 0.0
    for second, nonce, step in uses:
        clock = max(0.0, clock + step - 1)
        if abs(clock - second) > 5:
            continue  # the freshness check refuses it before the cache is asked
        if cache.first_use(second, nonce, clock) is True:
            assert (second, nonce) not in admitted
            admitted.add((second, nonce))
        assert cache.size() <= cap


@settings(max_examples=300, deadline=None)
@given(method=st.sampled_from(["GET", "PUT", "POST"]), target=st.text(max_size=80), body=st.binary(max_size=512),
       flip=st.integers(min_value=0, max_value=63))
def test_any_changed_mac_character_is_refused(method: str, target: str, body: bytes, flip: int) -> None:
    token = sign(KEYS, method, HOST, target, body, now=1000)
    head, mac = token.rsplit(".", 1)
    changed = mac[:flip] + ("0" if mac[flip] != "0" else "1") + mac[flip + 1:]
    assert _check(token, method=method, target=target, body=body) is Verdict.ALLOW
    assert _check(f"{head}.{changed}", method=method, target=target, body=body) is Verdict.REJECT
