"""``sglang-harden build-kernels``: compile the native digest and page-ledger libraries now, as an image's build
step, instead of at a server's start-up.

They go to ``$SGLANG_HARDEN_HOME/kernels`` (default ``~/.cache/sglang-harden/kernels``), keyed by source and flags
(the CPU features; for the ledger, this Python's headers: run it with the servers' Python). A server loads them
from the same folder, so set the same ``SGLANG_HARDEN_HOME`` where it runs.
Where a library is missing and cannot be built there (no compiler, a read-only folder), the server runs the
torch/numpy path instead (the same decisions, slower) and says so in a warning at start-up.

Exit codes: 0 both libraries built or already there; 1 at least one could not be built (the reason is printed).
"""

from __future__ import annotations

import argparse
import json

from sglang_harden.kernels import digest_native, ledger_native, native_build


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n\n", 1)[1]
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")


def build_all() -> dict[str, dict[str, object]]:
    """{library: {"built": bool, "detail": how it was built, or why not}}."""
    results: dict[str, dict[str, object]] = {}
    for name, status in (("digest", digest_native.native_status), ("ledger", ledger_native.native_status)):
        built, detail = status()
        results[name] = {"built": built, "detail": detail}
    return results


def run(args: argparse.Namespace) -> int:
    results = build_all()
    code = 0 if all(result["built"] for result in results.values()) else 1
    if args.json:
        print(json.dumps({"folder": str(native_build.cache_dir()), "libraries": results, "exit_code": code}, indent=2))
        return code
    print(f"folder: {native_build.cache_dir()}")
    for name, result in results.items():
        print(f"{name}: {'built' if result['built'] else 'NOT BUILT'} ({result['detail']})")
    if code:
        print("a server without these libraries runs the torch/numpy paths: the same decisions, slower")
    return code
