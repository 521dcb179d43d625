# 0.5.22: the 0.5.21 series, but the drain-acknowledgement functions changed (AckTarget, generations, and the
# "poisoned" rooms whose acknowledgement target upstream drops): the lifecycle patch edits those.
# The side-channel patch also covers the PP consensus store this release added.
from lifecycle_text import ACK_EDITS_0522, FREE_CONTEXTS_0522, NIXL_EDITS, lifecycle_patch
from side_channels_text import side_channels_patch
from spec_0_5_21 import PATCHES as _PATCHES_0521

_SIDE_CHANNELS = side_channels_patch(daemon_threads=True, polled_recv=True, nixl_bootstrap="bootstrap_thread_guarded",
                                     pp_store=True)
PATCHES = [lifecycle_patch(" " * 8, ACK_EDITS_0522 + NIXL_EDITS, free_contexts=FREE_CONTEXTS_0522)
           if name == "page-lifecycle" else _SIDE_CHANNELS if name == _SIDE_CHANNELS[0] else (name, header, edits)
           for name, header, edits in _PATCHES_0521]
