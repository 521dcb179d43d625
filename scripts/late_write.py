#!/usr/bin/env python3
"""Late-write fault injection, vanilla vs hardened, per pin, in one report (``--json`` for CI).

    python scripts/late_write.py --pin 0.5.19 --pin 0.5.23 --json
    python scripts/late_write.py --pin 0.5.23 --backend nixl --json

Each (pin, variant) runs on a fresh real CPU PD pair (see ``sglang_harden.testbed.latewrite``); pairs run one
at a time and are always stopped. Exit code: 0 when every hardened run is clean with every page back at
quiesce, 1 otherwise (or on an error), so CI can gate on it. Vanilla corruption is reported, not gated.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sglang_harden.testbed.latewrite import (  # noqa: E402
    BACKENDS,
    LateWriteSetup,
    collect_report,
    print_report,
    setup_for,
)
from sglang_harden.testbed.profiles import PROFILES  # noqa: E402


def _say(msg: str) -> None:
    print(f"[late-write] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--pin", action="append", dest="pins", default=None)
    parser.add_argument("--variant", action="append", dest="variants", choices=("vanilla", "hardened"))
    parser.add_argument("--backend", choices=BACKENDS, default=LateWriteSetup.backend,
                        help="PD transfer backend whose KV write lands late (nixl: pins that list it in pins.toml)")
    parser.add_argument("--delay-s", type=float, default=LateWriteSetup.delay_s)
    parser.add_argument("--blocking", action="store_true",
                        help="the late write blocks prefill's transfer worker instead of timing out the engine call")
    parser.add_argument("--decode-pool", type=int, default=None,
                        help="decode --max-total-tokens: small enough that freed pages are reused at once "
                             "(default: measured per page size, DECODE_POOL_BY_PAGE_SIZE)")
    parser.add_argument("--profile", choices=sorted(PROFILES), default=LateWriteSetup.profile,
                        help="testbed profile: KV page size, radix cache, chunked prefill, early send")
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    base = setup_for(args.profile, args.backend)
    setup = replace(base, delay_s=args.delay_s,
                    decode_max_total_tokens=args.decode_pool or base.decode_max_total_tokens,
                    engine_timeout_s=None if args.blocking else LateWriteSetup.engine_timeout_s)
    report = collect_report(args.pins or ["0.5.19", "0.5.23"], tuple(args.variants or ("vanilla", "hardened")),
                            setup, args.log_dir, _say)
    print_report(report, args.json)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
