"""doctor's reading of the model-shape gate from launch arguments (tools/launch_shapes.py)."""

from __future__ import annotations

import json
from pathlib import Path

from sglang_harden.config import GUARDS
from sglang_harden.guards.model_shape import KVShape
from sglang_harden.testbed.model import TINY_MLA_CONFIG
from sglang_harden.tools.launch_shapes import armed_guards, launch_shapes, shape_state


def _model(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_the_testbeds_mla_model_is_read_as_mla_and_a_draft_model_refuses_the_page_guards(tmp_path: Path) -> None:
    args = ["--model-path", str(_model(tmp_path, TINY_MLA_CONFIG))]
    assert launch_shapes(args)[0] == [KVShape.MLA]
    assert shape_state(args, list(GUARDS))["refused"] == []
    state = shape_state([*args, "--speculative-algorithm", "EAGLE"], list(GUARDS))
    assert state["refused"] == ["canary", "checksum", "lifecycle", "page_tags"], state
    assert "SGLANG_HARDEN_LIFECYCLE=off" in state["message"]


def test_a_llama_config_with_every_guard_starts(tmp_path: Path) -> None:
    args = [f"--model-path={_model(tmp_path, {'architectures': ['LlamaForCausalLM'], 'sliding_window': None})}"]
    state = shape_state(args, list(GUARDS))
    assert state == {**state, "shapes": ["mha"], "known": True, "refused": [], "message": ""}


def test_flags_and_hybrid_layers_are_read(tmp_path: Path) -> None:
    config = {"architectures": ["Qwen3NextForCausalLM"], "text_config": {
        "layer_types": ["linear_attention", "full_attention", "sliding_attention"]}}
    args = ["--model-path", str(_model(tmp_path, config)), "--speculative-algorithm", "EAGLE",
            "--enable-dp-attention", "--dp-size", "4"]
    shapes, details = launch_shapes(args)
    assert shapes == [KVShape.MHA, KVShape.SWA, KVShape.LINEAR_STATE, KVShape.SPECULATIVE, KVShape.DP_ATTENTION]
    assert details[1:] == ["--speculative-algorithm EAGLE", "attention DP (--dp-size 4, --attn-dp-size 1)"]
    assert launch_shapes(["--enable-dp-attention", "--dp-size", "1"])[0] == []
    assert launch_shapes(["--enable-dp-attention"])[0] == []  # SGLang's dp_size defaults to 1
    assert launch_shapes(["--attn-dp-size", "4"])[0] == [KVShape.DP_ATTENTION]  # 0.5.23's own flag
    nemotron_h = {"architectures": ["NemotronHForCausalLM"], "hybrid_override_pattern": "M-M*-"}
    assert KVShape.LINEAR_STATE in launch_shapes(["--model-path", str(_model(tmp_path, nemotron_h))])[0]


def test_the_armed_guards_follow_the_options_the_switches_and_activation() -> None:
    assert armed_guards([], {}) == (list(GUARDS), "")
    armed, _ = armed_guards(["--harden-lifecycle", "off", "--harden-page-tags=off"], {"SGLANG_HARDEN_CANARY": "log"})
    assert "lifecycle" not in armed and "page_tags" not in armed and "canary" in armed
    assert armed_guards([], {"SGLANG_HARDEN_ACTIVATE": "0"})[0] == []
    armed, why = armed_guards([], {"SGLANG_HARDEN_PAGE_TAG": "off"})  # mistyped on purpose (test_rollout_settings)
    assert armed == [] and "SGLANG_HARDEN_PAGE_TAGS" in why


def test_a_remote_model_id_is_said_to_be_unread() -> None:
    state = shape_state(["--model-path", "deepseek-ai/DeepSeek-V3"], list(GUARDS))
    assert state["known"] is False and "not a local folder" in state["read_from"][0]
