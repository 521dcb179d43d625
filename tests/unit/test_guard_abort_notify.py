from sglang_harden.guards.abort_notify import (
    AbortNotice,
    decide_on_peer_abort,
    decode_abort_notice,
    encode_abort_notice,
)
from sglang_harden.guards.base import Verdict


def test_nothing_in_flight_releases():
    d = decide_on_peer_abort("r", transfer_may_be_in_flight=False, writer_drained=False)
    assert d.verdict is Verdict.ABORT and d.fields["pages"] == "release"


def test_drained_releases():
    assert decide_on_peer_abort("r", True, True).fields["pages"] == "release"


def test_in_flight_quarantines():
    d = decide_on_peer_abort("r", True, False)
    assert d.verdict is Verdict.ABORT and d.fields["pages"] == "quarantine"


def test_notice_roundtrip():
    notice = AbortNotice(2**63 + 5, 400, "Input length (300 tokens)\nexceeds")
    back = decode_abort_notice(encode_abort_notice(notice))
    assert back == AbortNotice(2**63 + 5, 400, "Input length (300 tokens) exceeds")


def test_foreign_messages_are_not_notices():
    for raw in (b"", b"ABORT 1", b"sglang-harden/abort/1 x 400 y", b"\xff\xfe", b"sglang-harden/abort/1 5"):
        assert decode_abort_notice(raw) is None
    assert decode_abort_notice(b"sglang-harden/abort/1 5 500") == AbortNotice(5, 500, "")
