"""Which protections an SGLang build has, judged from its code (see :mod:`sglang_harden.tools._source`).

Each detector looks for the *behaviour* in the function where it has to live, not for a version number or
a PR's wording, so a backported or locally patched tree is recognised. What each one looks for:

- ``door_rejection``: ``PrefillBootstrapQueue.add`` and ``DecodePreallocQueue.add`` each contain an ``if``
  whose test reads the field ``Req.set_finish_with_abort`` writes (``to_finish`` from 0.5.4.post2, else
  ``finished_reason``), directly or through a helper it calls (``is_aborted``, ``is_unadmitted_reject``),
  and whose branch leaves the door (return/raise). Both doors must have it.
- ``abort_retirement``: in ``process_batch_result_disagg_prefill`` the final
  ``send_kv_chunk(..., last_chunk=True)`` is dominated by such an abort test with an early exit
  (``continue``/``return``), or ``send_kv_chunk`` itself starts with one.
- ``coverage_check``: ``DecodeTransferQueue._commit_transfer_to_req`` or ``pop_transferred`` (or a helper
  they call) has an ``if`` comparing a transferred/sent length and aborting (or raising) on mismatch.
- ``page_ownership``: ``_commit_transfer_to_req`` (or a helper it calls) has an ``if`` on a page-ownership
  verdict (names with page_tag / page_owner / ownership) that aborts, and the token and paged allocators' free
  paths tell that ledger of freed pages (partial when they do not). No SGLang release has it; the backport
  series' ``page-ownership-tags`` patch does.
- ``kv_checksum``: decode has a ``*checksum*`` function that compares two computed values and handles a
  mismatch, and prefill publishes one; server arg ``disaggregation_enable_kv_checksum`` gives the default.
- ``deferred_release``: decode reads ``SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE`` and has a
  ``*defer*`` release path; ``environ.py`` gives the default; backends = transfer ``conn.py`` modules that
  honour it (that set ``supports_deferred_decode_kv_release = True`` where the base class gates on it).
- ``page_quarantine``: the token and paged allocators' free paths reassign what they free from a call named for
  keeping pages back (quarantine / lifecycle / to_free), and ``pop_transferred`` calls one that lets quarantined
  pages out (partial when only some do). No SGLang release has it; the backport series' ``page-lifecycle`` does.
- ``kv_canary``: a ``kv_canary`` server-arg field and the ``kv_canary`` kernel package; default from the
  field. Or the backport series' canary: decode's commit path has an ``if`` on a canary verdict that
  aborts (``pd_canary.refusal_at_commit``), on by default.
- ``abort_ack``: prefill sends ``ABORT_ACK``; deferred until drained if ``register_deferred_ack_target``
  exists; the KV sender's ``clear()`` either drops the pending target unconditionally (0.5.19/0.5.20) or
  keeps it until the writes drain (calls a ``*drain*`` helper); generation-tagged if ``note_abort_ack``
  takes a ``generation``.
- ``transfer_batch_bound``: ``environ.py`` declares ``SGLANG_MOONCAKE_MAX_TRANSFER_BATCH_INDICES`` and
  ``mooncake/conn.py`` reads it; 0 means unbounded.
- ``decode_abort_notify``: a KV *sender*'s ``abort()`` (or a helper it calls) sends something to decode
  (a call named like notify / sync_status / send_multipart), so decode learns of a prefill-side abort.
- ``bootstrap_auth``: the bootstrap server's ``/route`` handlers read request headers or compare a secret
  (``compare_digest``, names with auth/token/secret/signature), or the aiohttp app has middlewares; opt-in
  (switch ``SGLANG_HARDEN_BOOTSTRAP_SECRET_FILE``) when ``_setup_routes`` hands the app to a module named for
  authentication (the backport series' ``pd_auth.protect(self.app)``).
- ``zmq_auth``: the KV manager's rank port verifies ZMQ messages and decode's sockets to it sign: calls into a
  module named for side channels / ZMQ auth in ``CommonKVManager.__init__`` and ``CommonKVReceiver._connect`` (the
  backport series' ``pd_side_channels``), opt-in with the secret file (switch ``SGLANG_HARDEN_ZMQ_AUTH``: off turns
  it off); partial when only one side is there. No SGLang release has it.

This module lists the protections and runs the detectors; they live in ``_detectors_request`` (door, retirement,
coverage, checksum), ``_detectors_transfer`` (deferred release, canary, abort ack, transfer batch) and
``_detectors_bootstrap`` (decode abort notify, bootstrap auth, ZMQ auth), on the verdict and helpers of
``_detect_base``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# the verdict, status values, abort_fields and BACKPORT_SECRET_ENV are read by doctor and the tests through this module
from sglang_harden.tools._detect_base import (  # noqa: F401
    NO,
    OPT_IN,
    PARTIAL,
    UNKNOWN,
    YES,
    Native,
    abort_fields,
)
from sglang_harden.tools._detectors_bootstrap import (  # noqa: F401
    BACKPORT_SECRET_ENV,
    BACKPORT_ZMQ_SWITCH,
    detect_bootstrap_auth,
    detect_decode_abort_notify,
    detect_zmq_auth,
)
from sglang_harden.tools._detectors_request import (
    detect_abort_retirement,
    detect_coverage_check,
    detect_door_rejection,
    detect_kv_checksum,
    detect_page_ownership,
)
from sglang_harden.tools._detectors_transfer import (
    detect_abort_ack,
    detect_deferred_release,
    detect_kv_canary,
    detect_page_quarantine,
    detect_transfer_batch_bound,
)
from sglang_harden.tools._source import SourceTree


@dataclass(frozen=True)
class Protection:
    key: str
    title: str
    guard: str | None  # the sglang-harden guard that supplies it (config.GUARDS name)


PROTECTIONS: tuple[Protection, ...] = (
    Protection("door_rejection", "rejection at both PD doors", "admission"),
    Protection("abort_retirement", "retire aborted prefill results", "retire"),
    Protection("coverage_check", "transferred-length check on decode commit", "coverage"),
    Protection("kv_checksum", "per-transfer KV checksum", "checksum"),
    Protection("page_ownership", "page ownership check on decode commit", "page_tags"),
    Protection("deferred_release", "deferred decode KV release", "lifecycle"),
    Protection("page_quarantine", "quarantine of pages a late write may still land in", "lifecycle"),
    Protection("kv_canary", "kv canary", "canary"),
    Protection("abort_ack", "abort acknowledgement", "lifecycle"),
    Protection("transfer_batch_bound", "bounded Mooncake transfer batch", "lifecycle"),
    Protection("decode_abort_notify", "decode told of prefill aborts", "abort_notify"),
    Protection("bootstrap_auth", "bootstrap /route authentication", "bootstrap_auth"),
    Protection("zmq_auth", "ZMQ side-channel message authentication", "zmq_auth"),
)


DETECTORS: dict[str, Callable[[SourceTree], Native]] = {
    "door_rejection": detect_door_rejection,
    "abort_retirement": detect_abort_retirement,
    "coverage_check": detect_coverage_check,
    "kv_checksum": detect_kv_checksum,
    "page_ownership": detect_page_ownership,
    "deferred_release": detect_deferred_release,
    "page_quarantine": detect_page_quarantine,
    "kv_canary": detect_kv_canary,
    "abort_ack": detect_abort_ack,
    "transfer_batch_bound": detect_transfer_batch_bound,
    "decode_abort_notify": detect_decode_abort_notify,
    "bootstrap_auth": detect_bootstrap_auth,
    "zmq_auth": detect_zmq_auth,
}


def inspect_tree(tree: SourceTree) -> dict[str, Native]:
    out = {}
    for key, detector in DETECTORS.items():
        try:
            out[key] = detector(tree)
        except RecursionError:
            out[key] = Native(UNKNOWN, "code too deeply nested to inspect")
    return out
