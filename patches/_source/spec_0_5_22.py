# 0.5.22: the 0.5.21 series, but the drain-acknowledgement functions changed (AckTarget, generations, and the
# "poisoned" rooms whose acknowledgement target upstream drops): the lifecycle patch edits those.
from common_text import ACK_EDITS_0522, FREE_CONTEXTS_0522, NIXL_EDITS, lifecycle_patch
from spec_0_5_21 import PATCHES as _PATCHES_0521

PATCHES = [lifecycle_patch(" " * 8, ACK_EDITS_0522 + NIXL_EDITS, free_contexts=FREE_CONTEXTS_0522)
           if name == "page-lifecycle" else (name, header, edits)
           for name, header, edits in _PATCHES_0521]
