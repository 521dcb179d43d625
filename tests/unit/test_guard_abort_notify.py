from sglang_harden.guards.abort_notify import decide_on_peer_abort
from sglang_harden.guards.base import Verdict


def test_nothing_in_flight_releases():
    d = decide_on_peer_abort("r", transfer_may_be_in_flight=False, writer_drained=False)
    assert d.verdict is Verdict.ABORT and d.fields["pages"] == "release"


def test_drained_releases():
    assert decide_on_peer_abort("r", True, True).fields["pages"] == "release"


def test_in_flight_quarantines():
    d = decide_on_peer_abort("r", True, False)
    assert d.verdict is Verdict.ABORT and d.fields["pages"] == "quarantine"


def test_bootstrap_failure_tells_decode_and_says_whether_kv_may_have_gone() -> None:
    from sglang_harden.guards.abort_notify import PAGES_QUARANTINE, PAGES_RELEASE, decide_on_bootstrap_failure

    never = decide_on_bootstrap_failure("r1", 7, "Aborted by AbortReq", chunks_queued=False)
    assert never.verdict is Verdict.ABORT and never.fields["pages"] == PAGES_RELEASE and never.status_code == 500
    queued = decide_on_bootstrap_failure("r1", 7, "Aborted by AbortReq", chunks_queued=True)
    assert queued.verdict is Verdict.ABORT and queued.fields["pages"] == PAGES_QUARANTINE
    assert decide_on_bootstrap_failure("r1", None, "x", chunks_queued=False).verdict is Verdict.SKIP


def test_pending_release_only_on_a_never_written_notice() -> None:
    from sglang_harden.guards.abort_notify import decide_on_pending_release

    assert decide_on_pending_release(7, False).verdict is Verdict.RELEASE
    assert decide_on_pending_release(7, True).verdict is Verdict.SKIP
    assert decide_on_pending_release(7, None).verdict is Verdict.SKIP
