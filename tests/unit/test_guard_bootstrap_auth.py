from sglang_harden.guards.base import Verdict
from sglang_harden.guards.bootstrap_auth import sign, verify

ARGS = (7, "10.0.0.1", 8998)


def test_valid_token_passes():
    token = sign("s3cret", *ARGS, timestamp=1000)
    assert verify("s3cret", *ARGS, token, max_age_s=30, now=1010).verdict is Verdict.ALLOW


def test_missing_malformed_forged_expired_are_401():
    token = sign("s3cret", *ARGS, timestamp=1000)
    cases = [
        verify("s3cret", *ARGS, None, 30, now=1000),
        verify("s3cret", *ARGS, "garbage", 30, now=1000),
        verify("s3cret", *ARGS, "v1.abc.def", 30, now=1000),
        verify("other", *ARGS, token, 30, now=1000),
        verify("s3cret", 8, "10.0.0.1", 8998, token, 30, now=1000),
        verify("s3cret", 7, "10.0.0.2", 8998, token, 30, now=1000),
        verify("s3cret", 7, "10.0.0.1", 8999, token, 30, now=1000),
        verify("s3cret", *ARGS, token, 30, now=1031),
        verify("s3cret", *ARGS, token, 30, now=960),
        verify("", *ARGS, token, 30, now=1000),
        verify("s3cret", *ARGS, token.replace("v1.1000", "v1.1001"), 30, now=1000),
    ]
    for d in cases:
        assert d.verdict is Verdict.REJECT and d.status_code == 401


def test_sign_uses_current_time_by_default():
    token = sign("k", *ARGS)
    assert verify("k", *ARGS, token, max_age_s=60).verdict is Verdict.ALLOW
