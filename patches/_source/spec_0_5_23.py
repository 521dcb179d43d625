# 0.5.23: the 0.5.22 series, but NIXL's failed post now "poisons" the room (the lifecycle patch's poison edit marks
# it as a failed write): no NIXL edit of its own (its exception path changed).
from lifecycle_text import ACK_EDITS_0522, FREE_CONTEXTS_0523, lifecycle_patch
from spec_0_5_22 import PATCHES as _PATCHES_0522

PATCHES = [lifecycle_patch(" " * 8, ACK_EDITS_0522, free_contexts=FREE_CONTEXTS_0523)
           if name == "page-lifecycle" else (name, header, edits)
           for name, header, edits in _PATCHES_0522]
