#!/usr/bin/env python3
"""Late-write fault injection, vanilla vs hardened, per pin, in one report (``--json`` for CI).

    python scripts/late_write.py --pin 0.5.19 --pin 0.5.23 --json

Each (pin, variant) runs on a fresh real CPU PD pair (see ``sglang_harden.testbed.latewrite``); pairs run one
at a time and are always stopped. Exit code: 0 when every hardened run is clean with every page back at
quiesce, 1 otherwise (or on an error), so CI can gate on it. Vanilla corruption is reported, not gated.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from sglang_harden.testbed.latewrite import LateWriteSetup, run_late_write


def _say(msg: str) -> None:
    print(f"[late-write] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pin", action="append", dest="pins", default=None)
    parser.add_argument("--variant", action="append", dest="variants", choices=("vanilla", "hardened"))
    parser.add_argument("--delay-s", type=float, default=LateWriteSetup.delay_s)
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    setup = LateWriteSetup(delay_s=args.delay_s)
    root = args.log_dir or Path(tempfile.mkdtemp(prefix="sglang-harden-latewrite-"))
    report: dict[str, dict[str, object]] = {}
    ok = True
    for pin in args.pins or ["0.5.19", "0.5.23"]:
        report[pin] = {}
        for variant in args.variants or ["vanilla", "hardened"]:
            _say(f"{pin} {variant}: starting (logs {root / pin / variant})")
            started = time.monotonic()
            try:
                res = run_late_write(pin, variant == "hardened", root / pin / variant, setup, _say)
            except Exception as exc:  # noqa: BLE001 - one broken pin must not hide the others
                res = {"verdict": "error", "error": f"{type(exc).__name__}: {exc}"[:2000]}
            res["wall_s"] = round(time.monotonic() - started, 1)
            report[pin][variant] = res
            _say(f"{pin} {variant}: {res.get('verdict')}")
            if variant == "hardened" and res.get("verdict") != "clean":
                ok = False
            if res.get("verdict") == "error":
                ok = False
    if args.json:
        print(json.dumps({"scenario": "late-write", "pins": report}, default=str))
    else:
        for pin, variants in report.items():
            for variant, res in variants.items():
                print(f"{pin:8} {variant:9} served={res.get('served_requests')} "
                      f"corrupted={res.get('corrupted_requests')} late_write_at={res.get('late_write_t_rel')}s "
                      f"pages_back={res.get('pages_back_at_quiesce')} verdict={res.get('verdict')}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
