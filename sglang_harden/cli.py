"""``sglang-harden``: one entry point; each subcommand lives in its own module.

A subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``. Modules are imported only
when their subcommand runs, so a broken optional dependency of one tool cannot break the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from sglang_harden import __version__

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("sglang_harden.tools.demo", "reproduce the incident on a tiny local model, vanilla vs hardened"),
    "doctor": ("sglang_harden.tools.doctor", "which protections this SGLang has, which guards are live"),
    "audit": ("sglang_harden.tools.audit", "pool vs context and guard status on running nodes"),
    "probe": ("sglang_harden.tools.probe", "end-to-end isolation probes against a running endpoint"),
    "model": ("sglang_harden.protocol.cli", "check the executable model of the PD handoff"),
    "testbed": ("sglang_harden.testbed.cli", "build pin environments and start/stop real PD pairs"),
    "soak": ("sglang_harden.tools.soak", "mixed, hostile traffic on a real PD topology, judged by independent oracles"),
    "patch": ("sglang_harden.tools.patch", "apply or verify the backport patch series on an SGLang tree"),
    "build-kernels": ("sglang_harden.tools.kernels", "compile the native digest and ledger libraries now (an image's "
                      "build step)"),
    "compat": ("sglang_harden.tools.compat_sweep", "judge SGLang releases against the plugin's hooks (reads their code"
               ", installs nothing)"),
}


def _known_command(argv: list[str]) -> str | None:
    for token in argv:
        if not token.startswith("-"):
            return token if token in SUBCOMMANDS else None
    return None


def build_parser(command: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sglang-harden", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"sglang-harden {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            importlib.import_module(module_name).add_arguments(sub_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _known_command(argv)
    args = build_parser(command).parse_args(argv)
    module = importlib.import_module(SUBCOMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
