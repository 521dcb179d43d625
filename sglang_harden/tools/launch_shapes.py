"""``doctor``'s view of the model-shape gate: the KV shapes a node's launch arguments give, read without starting it.

The server reads its shape from the pool SGLang built (``compat/model_shape.py``); before it starts, the launch
arguments say most of it: ``--speculative-algorithm``, attention DP (``--enable-dp-attention`` with ``--dp-size``),
and the model's ``config.json`` when ``--model-path`` is a local folder (MLA: ``kv_lora_rank``; sliding-window layers;
Mamba/linear-attention layers). A remote model id is not read: doctor says so instead of guessing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sglang_harden.config import ACTIVATE_ENV, GUARDS, ConfigError, Mode, load_config
from sglang_harden.guards.model_shape import KVShape, decide_shapes
from sglang_harden.launch_server import split_harden_args

_LINEAR_LAYER_WORDS = ("mamba", "linear_attention", "linear", "ssm")


def flag_value(args: list[str], *names: str) -> str | None:
    """The value of the first of ``names`` in launch arguments (``--x v`` or ``--x=v``), "set" for a flag given
    without a value, None when absent."""
    for i, arg in enumerate(args):
        for name in names:
            if arg == name:
                following = args[i + 1] if i + 1 < len(args) else ""
                return following if following and not following.startswith("--") else "set"
            if arg.startswith(name + "="):
                return arg.split("=", 1)[1]
    return None


def _model_config(args: list[str]) -> tuple[dict[str, Any] | None, str]:
    path = flag_value(args, "--model-path", "--model")
    if path is None:
        return None, "no --model-path"
    config = Path(path) / "config.json"
    if not config.is_file():
        return None, f"model {path} is not a local folder with a config.json: its attention kind is not read"
    try:
        return json.loads(config.read_text()), f"model config {config} (its keys, read as a heuristic)"
    except (OSError, ValueError) as exc:
        return None, f"model config {config} unreadable: {exc}"


def _config_shapes(config: dict[str, Any]) -> list[KVShape]:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    shapes = [KVShape.MLA] if text.get("kv_lora_rank") else [KVShape.MHA]
    layer_kinds = " ".join(str(k).lower() for k in (text.get("layer_types") or text.get("layers_block_type") or []))
    if "sliding" in layer_kinds or text.get("sliding_window_pattern"):
        shapes.append(KVShape.SWA)
    if any(word in layer_kinds for word in _LINEAR_LAYER_WORDS) or "M" in str(text.get("hybrid_override_pattern", "")) \
            or any("mamba" in str(a).lower() for a in config.get("architectures") or []):
        shapes.append(KVShape.LINEAR_STATE)
    return shapes


def launch_shapes(args: list[str]) -> tuple[list[KVShape], list[str]]:
    """The shapes the launch arguments give, and what each was read from."""
    config, source = _model_config(args)
    shapes = _config_shapes(config) if config is not None else []
    details = [source]
    speculative = flag_value(args, "--speculative-algorithm")
    if speculative and speculative.upper() != "NONE":
        shapes.append(KVShape.SPECULATIVE)
        details.append(f"--speculative-algorithm {speculative}")
    dp_size = flag_value(args, "--dp-size", "--dp") or "1"
    attn_dp_size = flag_value(args, "--attn-dp-size", "--attention-data-parallel-size") or "1"
    if ("--enable-dp-attention" in args and _above_one(dp_size)) or _above_one(attn_dp_size):
        shapes.append(KVShape.DP_ATTENTION)
        details.append(f"attention DP (--dp-size {dp_size}, --attn-dp-size {attn_dp_size})")
    return shapes, details


def _above_one(value: str) -> bool:
    return not value.isdigit() or int(value) > 1  # a width doctor cannot read counts as attention DP


def armed_guards(args: list[str], environ: dict[str, str]) -> tuple[list[str], str]:
    """The guards a node started with ``args`` and ``environ`` arms (their ``--harden-<guard>`` options and
    ``SGLANG_HARDEN_*`` variables), or ``([], why)`` when the plugin stays off or the settings are unusable."""
    if environ.get(ACTIVATE_ENV, "").strip() == "0":
        return [], f"{ACTIVATE_ENV}=0: the plugin is off"
    try:
        config = load_config({**environ, **split_harden_args(args)[0]})
    except ConfigError as exc:
        return [], f"settings unusable: {exc}"
    return [g for g in GUARDS if config.mode(g) is not Mode.OFF], ""


def shape_state(args: list[str], armed: list[str]) -> dict[str, Any]:
    """What the gate would decide at start-up with these arguments and the armed guards (``refused``: the guards
    that keep the node from starting; ``known``: False when the model's attention kind could not be read)."""
    shapes, details = launch_shapes(args)
    known = any(s in shapes for s in (KVShape.MHA, KVShape.MLA))
    decision = decide_shapes(shapes, armed, ", ".join(details))
    return {"shapes": [s.value for s in shapes], "read_from": details, "known": known,
            "refused": list(decision.fields.get("refused", [])), "message": "" if decision.allows else decision.reason}
