# 0.5.18: the 0.5.19 series, but 0.5.18's _is_fake_transfer also takes the server args (every anchor holds, yet the
# calls the series adds must match: measured on a patched 0.5.18 pair, whose decode scheduler died on the first commit).
from commit_checks_text import UNGATED_DIGEST_CHECK, digest_patch
from common_text import DECODE, MOONCAKE
from lifecycle_text import NOTICE_0519, lifecycle_patch, notice_arms_acks
from side_channels_text import side_channels_patch
from spec_0_5_19 import UNGATED_PATCHES as _PATCHES_0519

FAKE_0519 = "_is_fake_transfer(decode_req.req)"
FAKE_0518 = "_is_fake_transfer(decode_req.req, self.scheduler.server_args)"


def _for_0518(edit: tuple) -> tuple:
    rel, old, new = edit
    return (rel, old, new.replace(FAKE_0519, FAKE_0518)) if rel == DECODE else edit


# Drain acknowledgements: 0.5.18's Mooncake prefill answers decode's abort notice with ABORT_ACK at once (whether or
# not a chunk of the room is still being written) and its decode ignores it; there is no deferred decode KV release.
# The lifecycle patch brings its own: the transfer worker counts a chunk before it looks at the room's status (an
# abort seen after that look finds the chunk in flight), prefill acknowledges, naming its rank, once the room has no
# chunk in flight (pd_lifecycle.ack_when_drained / ack_if_drained), and decode counts only such acknowledgements
# (upstream's rank-less one says nothing about drained writes). 0.5.18's NIXL manager has no acknowledgement at all;
# there the quarantined pages of a failed transfer stay held until the prefill node is gone (safe, not reused).
STATUS_CHECK = ("                if (\n"
                "                    kv_chunk.room not in self.request_status\n"
                "                    or self.check_status(kv_chunk.room) == KVPoll.Failed\n"
                "                ):\n")
COUNT_FIRST = ("                # sglang-harden backport: count the chunk in flight before looking at the room's status, so\n"
               "                # an abort noticed after the look waits for it (pd_lifecycle acknowledges at zero)\n"
               "                if not kv_chunk.staging_counted:\n"
               "                    self._staging_outstanding[kv_chunk.room] += 1\n"
               "                    kv_chunk.staging_counted = True\n")
SKIPPED = "                    self._staging_outstanding.pop(kv_chunk.room, None)\n                    continue\n"
FINISHED = "                self._staging_outstanding[kv_chunk.room] -= 1\n"
ACK_UPSTREAM = "                    # Send ACK back to decode endpoint\n"
ACK_RECEIVED = '                    logger.debug(f"Received ABORT_ACK for room {ack_aborted_room}")\n'
ACK_EDITS_0518 = [
    (MOONCAKE, STATUS_CHECK, COUNT_FIRST + STATUS_CHECK),
    (MOONCAKE, SKIPPED, SKIPPED.replace(
        "                    continue\n",
        "                    pd_lifecycle.ack_if_drained(self, kv_chunk.room)  # sglang-harden backport\n"
        "                    continue\n")),
    (MOONCAKE, FINISHED, FINISHED +
     "                pd_lifecycle.ack_if_drained(self, kv_chunk.room)  # sglang-harden backport\n"),
    (MOONCAKE, ACK_UPSTREAM,
     "                    # sglang-harden backport: acknowledge once the room's writes drained, naming this rank\n"
     "                    if pd_lifecycle.ack_when_drained(\n"
     "                        self, room_to_be_aborted, decode_ip, decode_port\n"
     "                    ):\n"
     "                        continue\n" + ACK_UPSTREAM),
    (MOONCAKE, ACK_RECEIVED, ACK_RECEIVED +
     "                    if len(msg) >= 3:  # sglang-harden backport: a drain acknowledgement names its rank\n"
     "                        pd_lifecycle.ranked_ack_received(msg)\n"),
    notice_arms_acks(NOTICE_0519),
]


HEADER_0518 = """
On 0.5.18 (no drain acknowledgements upstream): Mooncake's transfer worker counts a chunk in flight
before it looks at the room's status, prefill answers decode's abort notice with an acknowledgement
naming its rank once no chunk of the room is in flight (held like any other while a failed write may
still land), and decode counts only those (upstream's rank-less ABORT_ACK is sent before anything
drained). There is no deferred decode KV release to turn on. 0.5.18's NIXL manager sends no
acknowledgement: there a failed transfer's pages stay held until the prefill node is gone.
"""


def _lifecycle_0518() -> tuple:
    name, header, edits = lifecycle_patch(" " * 12, ACK_EDITS_0518, deferred_release=False)
    return name, header + HEADER_0518, edits


_SERIES = [patch for patch in _PATCHES_0519 if patch[0] not in ("page-lifecycle", "kv-digest")]
PATCHES = [(name, header, [_for_0518(edit) for edit in edits])
           for name, header, edits in [*_SERIES, _lifecycle_0518(), digest_patch(decode=UNGATED_DIGEST_CHECK),
                                          side_channels_patch(daemon_threads=False, polled_recv=False,
                                                              nixl_decode="decode_staging_thread")]]
