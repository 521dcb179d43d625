"""The late-write scenario's quiesce on a patched pair (``testbed.latewrite`` with a patched tree, plugin off).

A patched decode reports no free-token count on ``/server_info`` (SGLang's ``token_capacity`` is the pool's size),
so "every page back" is shown by the backport series' own log line and by a request that does not fit while A's
pages are held.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

from sglang_harden.testbed.client import greedy_body, pd_generate
from sglang_harden.testbed.pd_topology import PDPair

QUARANTINE_LINE = re.compile(r"sglang-harden lifecycle quarantine: (\d+) KV pages of room:(\d+) ")


def patched_quarantined_pages(decode_log: str, room: int) -> int:
    """Pages of ``room`` a patched decode put in quarantine, from the series' log lines."""
    return sum(int(m.group(1)) for m in QUARANTINE_LINE.finditer(decode_log) if int(m.group(2)) == room)


def patched_quiesce(pair: PDPair, setup: Any, pool: dict[str, Any], say: Callable[[str], None] | None,
                    prompt: list[int]) -> dict[str, Any]:
    """A patched decode reports no free-token count (SGLang's ``token_capacity`` is the pool's size): wait for the
    series' log line saying A's pages left quarantine, then send a request whose prompt needs more of the pool
    than is free while A's pages are held. Both must happen for the pages to count as back."""
    line = f"KV pages of room:{setup.room_a} leave quarantine"
    deadline = time.monotonic() + setup.quiesce_timeout_s + setup.delay_s
    while time.monotonic() < deadline and line not in pair.decode.log_text():
        time.sleep(1.0)
    released = line in pair.decode.log_text()
    bport = int(pair.prefill.bootstrap_port or 0)
    length = setup.decode_max_total_tokens - setup.num_reserved_decode_tokens - 8
    big = pd_generate(pair.prefill.url, pair.decode.url, bport, greedy_body(prompt[:length], 2, rid="Q-full"),
                      timeout=120)
    (say or (lambda _m: None))(f"A's pages released: {released}; {length}-token request: {big.decode.status}")
    return {**pool, "patched_release_logged": released, "full_pool_request_status": big.decode.status,
            "full_pool_request_tokens": length}
