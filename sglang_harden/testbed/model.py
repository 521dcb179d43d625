"""The testbed's deterministic tiny models (no hub access): a Llama, a DeepSeek-V2-shaped MLA model, and a
Mellum-shaped model with sliding-window layers (SGLang serves it from a hybrid SWA pool).

Built by the pin's own python and transformers in a subprocess (files written by transformers 5.x do not
load in 4.x) and cached per transformers major version under ``$SGLANG_HARDEN_HOME/models/``.
2 layers, hidden 64, 4 heads, 2 KV heads, vocab 512, seed 0, byte-level BPE tokenizer trained offline.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from sglang_harden.testbed.envs import EnvError, get_recipe, harden_home, require_env
from sglang_harden.testbed.procenv import testbed_env

MODEL_VERSION = "1"
MAX_POSITIONS = 2048

_BUILD_SCRIPT = r"""
import json, os, random, sys
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

out, max_pos = sys.argv[1], int(sys.argv[2])
rng = random.Random(0)
words = ["tenant", "secret", "alpha", "bravo", "charlie", "delta", "echo", "kv", "page", "cache", "decode",
         "prefill", "token", "the", "of", "and", "a", "to", "in", "is", "memory", "request", "zulu", "omega"]
corpus = [" ".join(rng.choice(words) for _ in range(24)) for _ in range(400)]
corpus += ["".join(chr(32 + (i * 7 + j) % 95) for j in range(64)) for i in range(200)]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<s>", "</s>", "<pad>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
tok.train_from_iterator(corpus, trainer=trainer)
fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
fast.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
fast.model_max_length = max_pos
fast.save_pretrained(out)
torch.manual_seed(0)
config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_pos,
                     bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
                     initializer_range=0.1, rms_norm_eps=1e-5)
model = LlamaForCausalLM(config).to(torch.bfloat16)
model.save_pretrained(out, safe_serialization=True)
import transformers
print(json.dumps({"transformers": transformers.__version__}))
"""


def _transformers_major(python: Path) -> str:
    code = "import importlib.metadata as m; print(m.version('transformers').split('.')[0])"
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise EnvError(f"cannot read transformers' version with {python}: {proc.stderr[-500:]}")
    return proc.stdout.strip()


def model_dir_for(python: Path) -> Path:
    return harden_home() / "models" / f"tiny-llama-v{MODEL_VERSION}-tf{_transformers_major(python)}"


def build_tiny_model(pin: str, force: bool = False) -> Path:
    """Return the cached tiny model directory for ``pin``, building it with the pin's python if needed."""
    python = require_env(pin)
    target = model_dir_for(python)
    if (target / "config.json").exists() and not force:
        return target
    env = testbed_env(get_recipe(pin), {"PYTHONHASHSEED": "0"})

    def build(folder: Path) -> None:
        proc = subprocess.run([str(python), "-c", _BUILD_SCRIPT, str(folder), str(MAX_POSITIONS)],
                              capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0:
            raise EnvError(f"building the tiny model failed:\n{proc.stderr[-3000:]}")

    _build_in_place(target, build)
    return target


# A DeepSeek-V2-shaped model with MLA attention (MLATokenToKVPool), 2 dense layers (first_k_dense_replace = layers:
# no MoE kernel needed on CPU). kv_lora_rank = qk_nope_head_dim = v_head_dim: the torch_native backend's prefill
# attends with the latent row as K, which needs the query's width (measured: 32 vs 48 fails at the first extend).
# The CPU rotary factory takes deepseek_yarn only.
TINY_MLA_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_shared_experts": 1, "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 2,
    "moe_layer_freq": 1, "routed_scaling_factor": 1.0, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    "norm_topk_prob": False, "scoring_func": "softmax",
    "q_lora_rank": None, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16,
    "hidden_act": "silu", "max_position_embeddings": MAX_POSITIONS, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "rope_scaling": {"rope_type": "deepseek_yarn", "factor": 1.0, "original_max_position_embeddings": MAX_POSITIONS,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
    "torch_dtype": "bfloat16", "initializer_range": 0.1,
}
# The tiny MLA and SWA models have no weight file: SGLang's dummy loader fills them, seeded, alike on every server.
DUMMY_WEIGHTS = ("--load-format", "dummy")
TINY_MLA_FLAGS = DUMMY_WEIGHTS
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build_tiny_mla_model(pin: str) -> Path:
    """The tiny MLA model for ``pin`` (config and the tiny Llama's tokenizer; serve it with ``TINY_MLA_FLAGS``)."""
    return _config_only_model(pin, "mla", TINY_MLA_CONFIG)


# Mellum (SGLang's is_hybrid_swa_model lists it; 0.5.19 and 0.5.23 have it): sliding and full attention layers in
# turn, dense MLPs only (no MoE kernel on CPU). Its sliding-window layers' KV goes to SWAKVPool's second pool.
TINY_SWA_CONFIG = {
    "architectures": ["MellumForCausalLM"], "model_type": "mellum",
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": MAX_POSITIONS,
    "sliding_window": 16,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "mlp_layer_types": ["dense"] * 4, "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "norm_topk_prob": True, "router_aux_loss_coef": 0.001, "output_router_logits": False,
    "rope_parameters": {"full_attention": {"rope_theta": 500000.0, "rope_type": "default"},
                        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "attention_bias": False, "attention_dropout": 0.0,
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "dtype": "bfloat16",
    "initializer_range": 0.02, "use_cache": True,
}


def build_tiny_swa_model(pin: str) -> Path:
    """The tiny sliding-window model for ``pin`` (serve it with ``DUMMY_WEIGHTS``)."""
    return _config_only_model(pin, "swa", TINY_SWA_CONFIG)


def _config_only_model(pin: str, name: str, config_fields: dict[str, object]) -> Path:
    """A model folder of ``config_fields`` and the tiny Llama's tokenizer (its weights: SGLang's dummy loader)."""
    import json

    llama = build_tiny_model(pin)
    target = llama.parent / f"tiny-{name}-v{MODEL_VERSION}-{llama.name.rpartition('-')[2]}"
    config = json.dumps(config_fields, indent=1, sort_keys=True)
    if (target / "config.json").is_file() and (target / "config.json").read_text() == config:
        return target

    def build(folder: Path) -> None:
        for file_name in _TOKENIZER_FILES:
            if (llama / file_name).is_file():
                shutil.copy2(llama / file_name, folder / file_name)
        (folder / "config.json").write_text(config)

    _build_in_place(target, build)
    return target


TINY_MODELS = ("llama", "mla", "swa")


def tiny_model(pin: str, model: str) -> tuple[Path, tuple[str, ...]]:
    """The folder of one of the ``TINY_MODELS`` for ``pin`` and the server arguments it is served with."""
    if model == "llama":
        return build_tiny_model(pin), ()
    if model == "mla":
        return build_tiny_mla_model(pin), TINY_MLA_FLAGS
    if model == "swa":
        return build_tiny_swa_model(pin), DUMMY_WEIGHTS
    raise ValueError(f"tiny model {model!r}: one of {TINY_MODELS}")


def _build_in_place(target: Path, build: Callable[[Path], None]) -> None:
    """Fill a fresh folder beside ``target`` with ``build``, then put it in place of ``target`` (a reader never
    sees a half-built model; a failed build leaves nothing)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        build(tmp)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
