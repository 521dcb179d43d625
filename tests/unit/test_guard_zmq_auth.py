"""The ZMQ side-channel auth frame: sign/verify, what the MAC binds, replay window, rotation (pure logic)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_harden.guards import zmq_auth
from sglang_harden.guards.base import Verdict
from sglang_harden.guards.bootstrap_auth import MIN_SECRET_CHARS, parse_secrets
from sglang_harden.guards.zmq_auth import ReplayWindow, Signer, canonical_endpoint, split, verify

OLD = "o" * MIN_SECRET_CHARS
NEW = "n" * MIN_SECRET_CHARS
KEYS = parse_secrets(OLD)
DEST = "tcp://10.0.0.5:50001"
FRAMES = [b"None", b"10.0.0.9", b"50002", b"10.0.0.9:17001", b"\x00" * 16]


def _check(frames: list[bytes], auth: bytes | None, dest: str = DEST, keyring=KEYS, now: float = 1010,
           window: ReplayWindow | None = None) -> Verdict:
    return verify(keyring, frames, auth, dest, window or ReplayWindow(125), max_age_s=60, now=now)[0].verdict


def test_signed_message_passes_once_and_names_its_sender() -> None:
    signer = Signer()
    auth = signer.sign(KEYS, FRAMES, DEST, now=1000)
    window = ReplayWindow(125)
    decision, sender = verify(KEYS, FRAMES, auth, DEST, window, max_age_s=60, now=1010)
    assert decision.verdict is Verdict.ALLOW and sender == signer.sender
    assert _check(FRAMES, auth, window=window) is Verdict.REJECT, "a replay is refused"


def test_every_bound_part_matters() -> None:
    auth = Signer().sign(KEYS, FRAMES, DEST, now=1000)
    assert _check(FRAMES, auth) is Verdict.ALLOW
    assert _check([b"1234", *FRAMES[1:]], auth) is Verdict.REJECT, "message type / room"
    assert _check(FRAMES[:-1] + [b"\x01" * 16], auth) is Verdict.REJECT, "payload"
    assert _check(FRAMES[:-1], auth) is Verdict.REJECT, "a frame dropped"
    assert _check([FRAMES[0] + FRAMES[1], *FRAMES[2:]], auth) is Verdict.REJECT, "frames joined (length-prefixed)"
    assert _check(FRAMES, auth, dest="tcp://10.0.0.5:50003") is Verdict.REJECT, "another rank port"
    assert _check(FRAMES, auth, now=1000 + 61) is Verdict.REJECT, "stale"
    assert _check(FRAMES, auth, now=1000 - 61) is Verdict.REJECT, "from the future"
    assert _check(FRAMES, auth, keyring=parse_secrets(NEW)) is Verdict.REJECT, "another secret"
    forged = auth[:-1] + bytes([auth[-1] ^ 1])
    assert _check(FRAMES, forged) is Verdict.REJECT, "the MAC itself"
    other_sender = auth[:len(zmq_auth.MAGIC) + 16] + b"\x07" * 16 + auth[-32:]
    assert _check(FRAMES, other_sender) is Verdict.REJECT, "the sender id"


def test_unsigned_is_refused_with_its_own_reason() -> None:
    decision, sender = verify(KEYS, FRAMES, None, DEST, ReplayWindow(125))
    assert decision.verdict is Verdict.REJECT and decision.reason == zmq_auth.UNSIGNED and sender is None


def test_rotation_accepts_both_secrets_and_signs_with_the_first() -> None:
    rotating = parse_secrets(f"{NEW}\n{OLD}")
    assert _check(FRAMES, Signer().sign(KEYS, FRAMES, DEST, now=1000), keyring=rotating) is Verdict.ALLOW
    by_rotating = Signer().sign(rotating, FRAMES, DEST, now=1000)
    assert _check(FRAMES, by_rotating, keyring=parse_secrets(NEW)) is Verdict.ALLOW
    assert _check(FRAMES, by_rotating, keyring=KEYS) is Verdict.REJECT


def test_destination_spelling_is_canonical() -> None:
    assert canonical_endpoint("tcp://[::1]:5000") == canonical_endpoint("::1:5000") == "::1:5000"
    assert canonical_endpoint("TCP://10.0.0.5:5000") == "10.0.0.5:5000"
    auth = Signer().sign(KEYS, FRAMES, "tcp://[fe80::1]:5000", now=1000)
    assert _check(FRAMES, auth, dest="fe80::1:5000") is Verdict.ALLOW


def test_split_takes_only_a_well_formed_last_frame() -> None:
    auth = Signer().sign(KEYS, FRAMES, DEST)
    assert split([*FRAMES, auth]) == (FRAMES, auth)
    assert split(FRAMES) == (FRAMES, None)
    assert split([*FRAMES, auth[:-1]])[1] is None
    assert split([])[1] is None


def test_window_accepts_out_of_order_once_and_refuses_far_behind() -> None:
    window = ReplayWindow(125, width=8)
    sender = b"s" * 16
    assert [window.first_use(sender, seq, 0) for seq in (5, 3, 4, 3, 5)] == [True, True, True, False, False]
    assert window.first_use(sender, 20, 0) is True
    assert window.first_use(sender, 12, 0) is False, "8 or more behind the newest: refused"
    assert window.first_use(sender, 13, 0) is True


def test_window_forgets_idle_senders_and_is_full_rather_than_forgetful() -> None:
    window = ReplayWindow(100, max_senders=2)
    assert window.first_use(b"a" * 16, 1, 0) and window.first_use(b"b" * 16, 1, 50)
    assert window.first_use(b"c" * 16, 1, 60) is None, "full of live senders: cannot decide"
    assert window.first_use(b"c" * 16, 1, 101) is True, "a's window expired (idle past the validity)"
    assert window.size() == 2


def test_each_destination_counts_its_own_sequence() -> None:
    signer = Signer()
    assert [signer.next_seq("a:1"), signer.next_seq("a:1"), signer.next_seq("b:1")] == [1, 2, 1]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=6), st.binary(min_size=zmq_auth.AUTH_FRAME_BYTES,
                                                                  max_size=zmq_auth.AUTH_FRAME_BYTES))
def test_forged_frames_never_verify(frames: list[bytes], tail: bytes) -> None:
    forged = zmq_auth.MAGIC + tail[len(zmq_auth.MAGIC):]
    own, auth = split([*frames, forged])
    assert auth == forged
    assert _check(own, auth) is Verdict.REJECT
