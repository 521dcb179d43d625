"""The SGLang releases the plugin supports (each tested end to end on CPU), and the adapter family of each."""

from __future__ import annotations

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
