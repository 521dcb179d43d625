import random

import pytest

from sglang_harden.guards.base import Verdict
from sglang_harden.guards.coverage import (
    decide_commit,
    decode_coverage,
    encode_coverage,
    max_encodable_tokens,
)


def test_commit_allows_exact_coverage():
    assert decide_commit("r", 300, 300).verdict is Verdict.ALLOW


@pytest.mark.parametrize("sent", [1, 299, 301, 0])
def test_commit_aborts_on_mismatch(sent):
    d = decide_commit("r", 300, sent)
    assert d.verdict is Verdict.ABORT and str(sent) in d.reason and "300" in d.reason


def test_unknown_coverage_fails_closed():
    d = decide_commit("r", 300, None)
    assert d.verdict is Verdict.ABORT and "did not publish" in d.reason


@pytest.mark.parametrize("bits", [32, 64])
def test_roundtrip_and_fits_signed_width(bits):
    rng = random.Random(0)
    for _ in range(500):
        room, tokens = rng.getrandbits(64), rng.randrange(max_encodable_tokens(bits) + 1)
        value = encode_coverage(tokens, room, bits)
        assert -(1 << (bits - 1)) <= value < (1 << (bits - 1))
        assert decode_coverage(value, room, bits) == tokens


def test_zero_and_plain_counts_never_decode():
    for value in (0, 1, 250, 300, 2**30):
        assert decode_coverage(value, 12345) is None


def test_stale_value_from_other_room_is_rejected_almost_always():
    rng = random.Random(1)
    accepted = 0
    for _ in range(4000):
        old_room, new_room = rng.getrandbits(63), rng.getrandbits(63)
        if decode_coverage(encode_coverage(200, old_room), new_room) is not None:
            accepted += 1
    assert accepted < 4000 / 256 * 2  # tag is 8 bits on a 32-bit slot


def test_64_bit_tag_is_strong():
    rng = random.Random(2)
    value = encode_coverage(7, 1, bits=64)
    assert all(decode_coverage(value, rng.getrandbits(64) | 2, bits=64) is None for _ in range(2000))


def test_out_of_range_raises():
    with pytest.raises(ValueError):
        encode_coverage(max_encodable_tokens() + 1, 1)
    with pytest.raises(ValueError):
        encode_coverage(1, 1, bits=16)
