from common_text import *  # noqa: F403
from commit_checks_text import *  # noqa: F403
from lifecycle_text import *  # noqa: F403
import spec_0_5_20 as prev
from side_channels_text import side_channels_patch

_by_name = {name: (name, header, list(edits)) for name, header, edits in prev.PATCHES}

# 0.5.21+ has both doors upstream (retire_unadmitted_request) and retires aborted prefill results:
# no admission patch; the notice is posted from upstream's prefill door and retirement point.
notify_name, notify_header, notify_edits = _by_name["notify-decode-of-prefill-rejections"]
notify_edits = [e for e in notify_edits if e[1] is None or "req.finished_reason, req.to_finish = reason" not in e[1]]
notify_edits.append((
    PREFILL,
    "            self.scheduler.retire_unadmitted_request(req)\n            return\n",
    "            self.scheduler.retire_unadmitted_request(req)\n"
    "            pd_rejections.publish(self.kv_manager, req, sent_kv=False)  # sglang-harden backport\n"
    "            return\n",
))
notify_header = notify_header.replace(
    "at its door or before\n  the final send (upstream's _retire_aborted_prefill_result)",
    "at its door (upstream's\n  retire_unadmitted_request) or before the final send (_retire_aborted_prefill_result)")

PATCHES = [
    _by_name["coverage-publish-and-check"],
    (notify_name, notify_header, notify_edits),
    _by_name["capacity-gate"],
    _by_name["authenticate-control-plane"],
    _by_name["commit-gate"],
    page_tags_patch(" " * 8),  # the send_metadata call moved into _send_kv_metadata
    canary_patch(" " * 8),
    lifecycle_patch(" " * 8, ACK_EDITS_0521 + NIXL_EDITS, free_contexts=FREE_CONTEXTS_0520),
    digest_patch(),
    side_channels_patch(daemon_threads=True, polled_recv=True, nixl_bootstrap="bootstrap_thread_guarded"),
]
