"""``python -m sglang_harden.launch_server <sglang.launch_server args> [--harden-* options]``.

Takes every ``--harden-<name> <value>`` (or ``--harden-<name>=<value>``) out of the argument list, turns
them into ``SGLANG_HARDEN_*`` env vars, sets ``SGLANG_HARDEN_ACTIVATE=1`` so every process SGLang spawns
arms the guards through the start-up hook, arms this process, then runs ``sglang.launch_server`` as
``__main__`` with the remaining arguments. Options: see ``sglang_harden.config.HardenConfig``.
"""

from __future__ import annotations

import os
import runpy
import sys

from sglang_harden.config import ACTIVATE_ENV, ConfigError, flag_to_env


def split_harden_args(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """Return (env vars for the --harden-* options, the arguments meant for SGLang)."""
    env: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--harden-"):
            rest.append(token)
            i += 1
            continue
        if "=" in token:
            flag, value = token.split("=", 1)
            i += 1
        elif i + 1 < len(argv):
            flag, value = token, argv[i + 1]
            i += 2
        else:
            raise ConfigError(f"{token} needs a value")
        key, checked = flag_to_env(flag, value)
        env[key] = checked
    return env, rest


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        env, sglang_args = split_harden_args(argv)
    except ConfigError as exc:
        print(f"sglang-harden: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    os.environ.update(env)
    os.environ[ACTIVATE_ENV] = "1"
    from sglang_harden.compat import activate, reconfigure
    from sglang_harden.compat.runtime import HardenRefusal

    try:
        activate(source="launcher")
        reconfigure()
    except (HardenRefusal, ConfigError) as exc:
        print(f"sglang-harden: refusing to run unguarded: {exc}", file=sys.stderr)
        raise SystemExit(78) from None
    sys.argv = ["sglang.launch_server", *sglang_args]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
