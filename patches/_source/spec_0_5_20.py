from common_text import *  # noqa: F403
from commit_checks_text import *  # noqa: F403
from lifecycle_text import *  # noqa: F403
import spec_0_5_19 as base
from side_channels_text import side_channels_patch

_by_name = {name: (name, header, list(edits)) for name, header, edits in base.PATCHES}

# 0.5.20 already retires aborted prefill results itself (_retire_aborted_prefill_result): no 0002;
# the notice is posted from upstream's retirement point instead of ours.
notify_name, notify_header, notify_edits = _by_name["notify-decode-of-prefill-rejections"]
notify_edits = [e for e in notify_edits if e[1] is None or ("retire_before_final_send" not in e[1]
                and "disagg_kv_sender.abort()\n\n    def send_kv_chunk" not in e[1])]
notify_edits.append((
    PREFILL,
    "        if req.to_finish is not None and not req.finished():\n"
    "            req.update_finish_state()\n"
    "        maybe_release_metadata_buffer(req, self.req_to_metadata_buffer_idx_allocator)\n",
    "        if req.to_finish is not None and not req.finished():\n"
    "            req.update_finish_state()\n"
    "        pd_rejections.publish(self.disagg_prefill_bootstrap_queue.kv_manager, req)  # sglang-harden\n"
    "        maybe_release_metadata_buffer(req, self.req_to_metadata_buffer_idx_allocator)\n",
))

PATCHES = [
    _by_name["admission-at-both-doors"],
    _by_name["coverage-publish-and-check"],
    (notify_name, notify_header.replace(
        "the final send", "the final send (upstream's _retire_aborted_prefill_result)"), notify_edits),
    _by_name["capacity-gate"],
    _by_name["authenticate-control-plane"],
    _by_name["commit-gate"],
    _by_name["page-ownership-tags"],
    _by_name["kv-canary"],
    lifecycle_patch(" " * 12, ACK_EDITS_0519 + CLEAR_EDITS_0519 + NIXL_EDITS, free_contexts=FREE_CONTEXTS_0520),
    _by_name["kv-digest"],
    side_channels_patch(daemon_threads=False, polled_recv=False),
]
