"""The SGLang releases the plugin supports (each tested end to end on CPU), and the adapter family of each."""

from __future__ import annotations

import re

RELEASE_RE = re.compile(r"^(\d+)\.(\d+)\.(\d+)(?:\.post(\d+))?$")

# pin -> family module (under sglang_harden.compat)
SUPPORTED_PINS: dict[str, str] = {
    "0.4.9.post6": "sglang_v049",
    "0.4.10.post2": "sglang_v049",
    "0.5.19": "sglang_v05",
    "0.5.20": "sglang_v05",
    "0.5.21": "sglang_v05",
    "0.5.22": "sglang_v05",
    "0.5.23": "sglang_v05",
}

# A file every backport series adds (patches/<pin>/*-authenticate-control-plane.patch): its presence marks a tree
# that carries the series, where the plugin stays off (the series holds the guards; both would hook twice).
PATCHED_TREE_MARKER = ("srt", "disaggregation", "common", "pd_auth.py")


def patched_tree_marker() -> str | None:
    """The path of the series' marker file in the installed SGLang, or None (found without importing SGLang)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("sglang")
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        marker = Path(location).joinpath(*PATCHED_TREE_MARKER)
        if marker.is_file():
            return str(marker)
    return None


def release_key(version: str) -> tuple[int, int, int, int]:
    """Order of final releases (``0.4.9 < 0.4.9.post1 < 0.4.10``); ValueError for anything else (rc, dev)."""
    match = RELEASE_RE.match(version)
    if match is None:
        raise ValueError(f"not a final SGLang release number: {version!r}")
    major, minor, micro, post = match.groups()
    return int(major), int(minor), int(micro), int(post) if post is not None else -1
