"""Abort notification guard: when prefill gives up on a bootstrapped request, decode hears it and lets go.

Invariant: after prefill aborts or fails a request whose bootstrap room decode already holds, decode
aborts that request promptly (seconds, not its waiting timeout) and its pages leave the request: back to
the free list if no write can still land (nothing was in flight, or the writer confirmed it drained), into
quarantine otherwise.

The notices travel over prefill's bootstrap server (``channels/abort_wire.py``: JSON at ``/pd_rejections``, the
backport series' format too); this module only decides.
"""

from __future__ import annotations

from sglang_harden.guards.base import Decision, Verdict

GUARD = "abort_notify"
PAGES_RELEASE = "release"
PAGES_QUARANTINE = "quarantine"


def decide_on_peer_abort(rid: str, transfer_may_be_in_flight: bool, writer_drained: bool) -> Decision:
    """ABORT the decode request now; ``fields['pages']`` says: release or quarantine its pages."""
    safe = writer_drained or not transfer_may_be_in_flight
    pages = PAGES_RELEASE if safe else PAGES_QUARANTINE
    why = "no write can still land" if safe else "a write from prefill may still land"
    reason = f"prefill aborted request {rid}; {pages} its pages ({why})"
    return Decision(GUARD, Verdict.ABORT, reason, 500, {"rid": rid, "pages": pages})


def decide_on_prefill_abort(rid: str, room: int | None, message: str, status_code: int | None) -> Decision:
    """Prefill ended a bootstrapped request with an abort (its own retirement path, a client abort): ABORT
    on decode too, with prefill's message. A KV chunk may already have gone out, so decode quarantines."""
    if room is None:
        return Decision(GUARD, Verdict.SKIP, "no bootstrap room: not a PD request", None, {"rid": rid})
    reason = f"prefill aborted request {rid}: {message}"
    return Decision(GUARD, Verdict.ABORT, reason, status_code or 500, {"rid": rid, "room": room,
                                                                       "pages": PAGES_QUARANTINE})


def decide_on_bootstrap_failure(rid: str, room: int | None, message: str, chunks_queued: bool) -> Decision:
    """Prefill's handshake for a request failed (the client hung up, decode went away, a bootstrap error) before
    its transfer could run. Decode is holding pages for it and would wait out its own timeout: ABORT there too.
    When no KV chunk of the room was ever queued for sending, decode may release at once; otherwise (or when
    that is unknown) it quarantines until the writer drains."""
    if room is None:
        return Decision(GUARD, Verdict.SKIP, "no bootstrap room: not a PD request", None, {"rid": rid})
    pages = PAGES_QUARANTINE if chunks_queued else PAGES_RELEASE
    reason = f"prefill gave up on request {rid} during its handshake: {message}"
    return Decision(GUARD, Verdict.ABORT, reason, 500, {"rid": rid, "room": room, "pages": pages})


def decide_on_pending_release(room: int, peer_sent_kv: bool | None) -> Decision:
    """Decode holds an aborted room's pages until prefill acknowledges that its writes drained. Prefill said it
    never queued a write for the room (``peer_sent_kv`` False): nothing can land, RELEASE without the ack.
    Anything else (no notice, or a notice that KV may have gone out): keep waiting (SKIP)."""
    if peer_sent_kv is False:
        return Decision(GUARD, Verdict.RELEASE, f"prefill never queued a KV write for room {room}; released "
                        "without waiting for a drain ack", None, {"room": room})
    return Decision(GUARD, Verdict.SKIP, "no notice that the room was never written", None, {"room": room})


def decide_on_front_door_refusal(rid: str, room: int | None, message: str) -> Decision:
    """Prefill's front door (tokenization, validation) refused a request before its scheduler saw it.

    Decode got the same request from the router and is reserving pages for it: tell it (ABORT, HTTP 400 with
    prefill's own message). No sender was ever made, so decode may release its pages at once. A request
    without a bootstrap room was not a PD request: nothing to tell (SKIP)."""
    if room is None:
        return Decision(GUARD, Verdict.SKIP, "no bootstrap room: not a PD request", None, {"rid": rid})
    reason = f"prefill refused request {rid} before scheduling: {message}"
    return Decision(GUARD, Verdict.ABORT, reason, 400, {"rid": rid, "room": room, "pages": PAGES_RELEASE})


def decide_on_front_answer(rid: str, room: int, status_code: int, message: str) -> Decision:
    """Prefill refused or aborted a room whose client is waiting on decode's HTTP server. ABORT: answer that
    client now, with prefill's status and message, from decode's front (its tokenizer process) instead of after
    decode's scheduler gets round to it (seconds per loop on a saturated host). The scheduler still fails the
    room on the same notice and decides about its pages; this decision touches no page."""
    reason = f"prefill ended request {rid}: {message}"
    return Decision(GUARD, Verdict.ABORT, reason, status_code, {"rid": rid, "room": room, "answered": "front"})
