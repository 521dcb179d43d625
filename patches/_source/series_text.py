"""The series' stamp and report (part of the authentication patch, whose module carries them): the release of
sglang-harden that generated the series and the plugin's setting names, inlined into ``pd_auth.py``; and the
scheduler edit that puts the series on ``/server_info``."""
from __future__ import annotations

import sys
from pathlib import Path


def series_stamp() -> str:
    """The version of sglang-harden that generated the series, and the plugin's own setting names (a patched node
    recognises them, and refuses only a name no sglang-harden reads)."""
    repo = str(Path(__file__).resolve().parents[2])
    if repo not in sys.path:
        sys.path.insert(0, repo)
    from sglang_harden import __version__
    from sglang_harden.config import ENV_PREFIX, setting_names

    suffixes = sorted(name.removeprefix(ENV_PREFIX) for name in setting_names())
    lines = ["SERIES_VERSION = " + repr(__version__) + "  # the sglang-harden release that generated this series",
             "# the plugin's settings, without the prefix (a series setting may be one too)",
             "PLUGIN_SETTING_SUFFIXES = frozenset({"]
    line = "   "
    for suffix in suffixes:
        if len(line) + len(suffix) + 4 > 116:
            lines.append(line)
            line = "   "
        line += f" {suffix!r},"
    return "\n".join([*lines, line, "})", ""])


# /server_info: the scheduler's internal state names the series (the same anchor on every release with a series)
SERVER_INFO_ANCHOR = "    def get_internal_state(self, recv_req: GetInternalStateReq):\n"


def server_info_edits(sched: str) -> list:
    """The scheduler's ``get_internal_state`` wrapped so that ``/server_info`` names the series (``sched``: the
    scheduler's file)."""
    return [(sched, SERVER_INFO_ANCHOR, '''    def get_internal_state(self, recv_req: GetInternalStateReq):
        # sglang-harden backport: /server_info names the backport series this tree carries
        output = self._get_internal_state_before_sglang_harden(recv_req)
        state = getattr(output, "internal_state", None)
        if isinstance(state, dict):
            try:
                from sglang.srt.disaggregation.common import pd_auth

                state["sglang_harden"] = pd_auth.server_info_block()
            except Exception as exc:  # evidence only: never fail /server_info
                state["sglang_harden"] = {"family": "patched", "error": str(exc)}
        return output

    def _get_internal_state_before_sglang_harden(self, recv_req: GetInternalStateReq):
''')]
