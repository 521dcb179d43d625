# 0.5.18: the 0.5.19 series, but 0.5.18's _is_fake_transfer also takes the server args (every anchor holds, yet the
# calls the series adds must match: measured on a patched 0.5.18 pair, whose decode scheduler died on the first commit).
from common_text import DECODE
from spec_0_5_19 import PATCHES as _PATCHES_0519

FAKE_0519 = "_is_fake_transfer(decode_req.req)"
FAKE_0518 = "_is_fake_transfer(decode_req.req, self.scheduler.server_args)"


def _for_0518(edit: tuple) -> tuple:
    rel, old, new = edit
    return (rel, old, new.replace(FAKE_0519, FAKE_0518)) if rel == DECODE else edit


# No page-lifecycle patch: 0.5.18 has no drain acknowledgements (deferred decode KV release came with 0.5.19), so a
# quarantined page would never leave quarantine.
PATCHES = [(name, header, [_for_0518(edit) for edit in edits]) for name, header, edits in _PATCHES_0519
           if name != "page-lifecycle"]
