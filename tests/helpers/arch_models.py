"""Tiny random-weight models of each architecture family mlx-lm ships, built with its own
classes (``mlx_lm.models.<family>.Model``) so that every layer kind of a family appears.

Each model is a directory (config.json, model.safetensors, tokenizer files) that
``mlx_lm.load`` and ``python -m mlx_server -m DIR`` both load. Builds are deterministic
(fixed seeds, the same bytes every build) and fast (the whole set in a few seconds).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiny_model import CHATML, SPECIALS, build_tokenizer

TEMPLATES = Path(__file__).parents[1] / "data" / "templates"

# Sizes shared by every family: 4 heads of 16, 2 KV heads.
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
FFN = 128
WINDOW = 16  # sliding-window layers: small, so that short prompts already pass the window

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}


@dataclass(frozen=True)
class Family:
    """One architecture: its mlx-lm config (less the vocabulary), its chat template."""

    name: str
    config: dict[str, Any]
    template: str | None = None  # a file in tests/data/templates; None: ChatML
    bos: str | None = None
    eos: str = "<|im_end|>"
    extra_specials: tuple[str, ...] = field(default_factory=tuple)
    # The cache kinds mlx-lm makes for it, one per distinct layer kind.
    caches: frozenset[str] = frozenset({"KVCache"})


def _base(model_type: str, **over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "model_type": model_type,
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    }
    cfg.update(over)
    return cfg


_MOE = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
}

_QWEN3_5_TEXT = {
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 2,  # layers 0, 2 linear (gated delta); 1, 3 full attention
    "rope_parameters": {
        "type": "default",
        "mrope_section": [2, 1, 1],
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
    },
}

QWEN3_TEMPLATE = "Qwen-Qwen3-0.6B.jinja"

# Recurrent state (gated delta, Mamba, short convolutions) beside full attention.
HYBRID = frozenset({"ArraysCache", "KVCache"})
# Sliding-window layers beside global ones.
SLIDING = frozenset({"RotatingKVCache", "KVCache"})

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        Family("llama", _base("llama")),
        Family(
            "llama3",
            _base("llama", rope_scaling=LLAMA3_ROPE),
            template="meta-llama-Llama-3.2-3B-Instruct.jinja",
            bos="<|begin_of_text|>",
            eos="<|eot_id|>",
        ),
        Family("qwen3", _base("qwen3"), template=QWEN3_TEMPLATE),
        Family("qwen3_moe", _base("qwen3_moe", **_MOE), template=QWEN3_TEMPLATE),
        Family(
            "qwen3_5",
            {
                "model_type": "qwen3_5",
                "text_config": _base("qwen3_5", num_hidden_layers=4, **_QWEN3_5_TEXT),
            },
            template=QWEN3_TEMPLATE,
            caches=HYBRID,
        ),
        Family(
            "qwen3_5_moe",
            {
                "model_type": "qwen3_5_moe",
                "text_config": _base(
                    "qwen3_5_moe",
                    num_hidden_layers=4,
                    shared_expert_intermediate_size=32,
                    **_QWEN3_5_TEXT,
                    **_MOE,
                ),
            },
            template=QWEN3_TEMPLATE,
            caches=HYBRID,
        ),
        Family(
            "qwen3_next",
            _base(
                "qwen3_next",
                num_hidden_layers=4,
                shared_expert_intermediate_size=32,
                partial_rotary_factor=0.5,
                **{k: v for k, v in _QWEN3_5_TEXT.items() if k != "rope_parameters"},
                **_MOE,
            ),
            template=QWEN3_TEMPLATE,
            caches=HYBRID,
        ),
        Family(
            "gemma3_text",
            _base(
                "gemma3_text",
                num_hidden_layers=3,
                sliding_window=WINDOW,
                sliding_window_pattern=3,  # layers 0, 1 sliding; 2 global
                query_pre_attn_scalar=HEAD_DIM,
            ),
            caches=SLIDING,
        ),
        Family(
            "gemma4_text",
            _base(
                "gemma4_text",
                num_hidden_layers=4,
                num_key_value_heads=1,
                global_head_dim=32,
                sliding_window=WINDOW,
                layer_types=[
                    "sliding_attention",
                    "full_attention",
                    "sliding_attention",
                    "full_attention",
                ],
                num_kv_shared_layers=2,  # layers 2, 3 reuse the KV of layers 0, 1 (E2B-like)
                hidden_size_per_layer_input=16,
                vocab_size_per_layer_input=None,  # set to the vocabulary
            ),
            caches=SLIDING,
        ),
        Family(
            "gemma4_moe",
            _base(
                "gemma4_text",
                num_hidden_layers=2,
                num_key_value_heads=1,
                num_global_key_value_heads=1,
                global_head_dim=32,
                sliding_window=WINDOW,
                layer_types=["sliding_attention", "full_attention"],
                num_kv_shared_layers=0,
                hidden_size_per_layer_input=0,
                attention_k_eq_v=True,
                use_double_wide_mlp=False,
                enable_moe_block=True,
                num_experts=4,
                top_k_experts=2,
                moe_intermediate_size=32,
            ),
            caches=SLIDING,
        ),
        Family(
            "gpt_oss",
            _base(
                "gpt_oss",
                num_hidden_layers=2,
                layer_types=["sliding_attention", "full_attention"],
                sliding_window=WINDOW,
                num_local_experts=4,
                num_experts_per_tok=2,
                intermediate_size=32,
                rope_scaling={
                    "rope_type": "yarn",
                    "factor": 32.0,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "truncate": False,
                    "original_max_position_embeddings": 4096,
                },
            ),
            template="openai-gpt-oss-120b.jinja",
            bos="<|startoftext|>",
            eos="<|return|>",
            extra_specials=("<|startoftext|>", "<|constrain|>"),
            caches=SLIDING,
        ),
        Family(
            "nemotron_h",
            _base(
                "nemotron_h",
                hybrid_override_pattern=["M", "*", "-", "E"],
                attention_bias=False,
                mamba_num_heads=4,
                mamba_head_dim=16,
                mamba_proj_bias=False,
                ssm_state_size=16,
                conv_kernel=4,
                n_groups=1,
                mlp_bias=False,
                layer_norm_epsilon=1e-5,
                use_bias=False,
                use_conv_bias=True,
                moe_intermediate_size=32,
                moe_shared_expert_intermediate_size=32,
                n_group=1,
                n_routed_experts=4,
                n_shared_experts=1,
                topk_group=1,
                num_experts_per_tok=2,
                norm_topk_prob=True,
                routed_scaling_factor=1.0,
            ),
            template="NVIDIA-Nemotron-Nano-v2.jinja",
            eos="<SPECIAL_12>",
            caches=HYBRID,
        ),
        Family(
            "granitemoehybrid",
            _base(
                "granitemoehybrid",
                num_hidden_layers=3,
                layer_types=["mamba", "attention", "mamba"],
                attention_bias=False,
                embedding_multiplier=12.0,
                attention_multiplier=0.0625,
                logits_scaling=8.0,
                residual_multiplier=0.25,
                num_local_experts=4,
                num_experts_per_tok=2,
                shared_intermediate_size=32,
                intermediate_size=32,
                mamba_n_heads=4,
                mamba_d_head=32,  # heads x head = 2 x hidden, as transformers checks
                mamba_proj_bias=False,
                mamba_d_state=16,
                mamba_d_conv=4,
                mamba_n_groups=1,
                mamba_conv_bias=True,
                position_embedding_type="rope",
            ),
            template="ibm-granite-granite-3.3-2B-Instruct.jinja",
            eos="<|end_of_text|>",
            caches=HYBRID,
        ),
        Family(
            "lfm2",
            _base(
                "lfm2",
                num_hidden_layers=3,
                norm_eps=1e-5,
                conv_bias=False,
                conv_L_cache=3,
                block_dim=HIDDEN,
                block_multiple_of=16,
                block_ffn_dim_multiplier=1.0,
                block_auto_adjust_ff_dim=False,
                block_ff_dim=FFN,
                layer_types=["conv", "full_attention", "conv"],
            ),
            caches=HYBRID,
        ),
        Family(
            "mistral3",
            {
                "model_type": "mistral3",
                "text_config": _base(
                    "ministral3",
                    rope_parameters={
                        "rope_type": "yarn",
                        "rope_theta": 10000.0,
                        "factor": 16.0,
                        "beta_fast": 32.0,
                        "beta_slow": 1.0,
                        "mscale": 1.0,
                        "mscale_all_dim": 1.0,
                        "original_max_position_embeddings": 256,
                        "llama_4_scaling_beta": 0.1,
                    },
                ),
            },
            template="Mistral-Small-3.2-24B-Instruct-2506.jinja",
            bos="<s>",
            eos="</s>",
            extra_specials=("<s>", "</s>"),
        ),
        Family(
            "glm4_moe",
            _base(
                "glm4_moe",
                num_hidden_layers=2,
                moe_intermediate_size=32,
                norm_topk_prob=True,
                n_group=1,
                topk_group=1,
                n_shared_experts=1,
                n_routed_experts=4,
                routed_scaling_factor=1.0,
                num_experts_per_tok=2,
                first_k_dense_replace=1,  # layer 0 dense, layer 1 MoE
                rope_scaling=None,
                use_qk_norm=True,
                attention_bias=True,
                partial_rotary_factor=0.5,
            ),
            template="GLM-4.6.jinja",
            eos="<|user|>",
            extra_specials=("[gMASK]", "<|endoftext|>"),
        ),
        Family(
            "deepseek_v3",
            _base(
                "deepseek_v3",
                num_hidden_layers=2,
                num_key_value_heads=HEADS,
                moe_intermediate_size=32,
                n_shared_experts=1,
                n_routed_experts=4,
                num_experts_per_tok=2,
                kv_lora_rank=32,
                q_lora_rank=32,
                qk_rope_head_dim=8,
                v_head_dim=16,
                qk_nope_head_dim=16,
                first_k_dense_replace=1,  # layer 0 dense, layer 1 MoE; both MLA
            ),
            template="deepseek-ai-DeepSeek-V3.1.jinja",
            bos="<｜begin▁of▁sentence｜>",
            eos="<｜end▁of▁sentence｜>",
            extra_specials=("<｜begin▁of▁sentence｜>",),
        ),
        Family(
            "olmo3",
            _base(
                "olmo3",
                num_hidden_layers=2,
                sliding_window=WINDOW,
                layer_types=["sliding_attention", "full_attention"],
            ),
            caches=SLIDING,
        ),
        Family(
            "phi3",
            _base("phi3", tie_word_embeddings=False),
            template="microsoft-Phi-3.5-mini-instruct.jinja",
            eos="<|end|>",
            extra_specials=("<|endoftext|>",),
        ),
    ]
}

# A template's own control tokens, single tokens in the real vocabularies.
_CONTROL = re.compile(
    r"<\|[A-Za-z_0-9]+\|>|<｜[^｜]+｜>|\[/?[A-Z_]{3,}\]|<SPECIAL_\d+>|</?[a-z_]+>"
)


def _template(family: Family) -> str:
    if family.template is None:
        return CHATML
    return (TEMPLATES / family.template).read_text(encoding="utf-8")


def _specials(family: Family, template: str) -> list[str]:
    bos = [family.bos] if family.bos else []
    found = [*SPECIALS, *bos, *family.extra_specials, *_CONTROL.findall(template), family.eos]
    return list(dict.fromkeys(found))  # unique, in order: the same ids every build


def _model_class(config: dict[str, Any]):
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    return module.Model(module.ModelArgs.from_dict(config))


def _set_vocab(config: dict[str, Any], vocab_size: int, eos_id: int, pad_id: int) -> dict[str, Any]:
    config = json.loads(json.dumps(config))  # a deep copy: FAMILIES stays as declared
    text = config.get("text_config", config)
    text["vocab_size"] = vocab_size
    if "vocab_size_per_layer_input" in text:
        text["vocab_size_per_layer_input"] = vocab_size
    config["eos_token_id"] = eos_id
    config["pad_token_id"] = pad_id
    return config


def _with_head_dim(config: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """The attention heads ``head_dim`` wide (a quantized KV cache needs a multiple of its
    group size, 32 at least), where the family's config sets their width."""
    text = config.get("text_config", config)
    for key in ("head_dim", "query_pre_attn_scalar", "global_head_dim", "qk_rope_head_dim"):
        if key in text:
            text[key] = max(text[key], head_dim)
    # Families that take the width as hidden size / heads (phi3, lfm2, granitemoehybrid).
    text["num_attention_heads"] = max(1, HIDDEN // head_dim)
    text["num_key_value_heads"] = min(text["num_key_value_heads"], text["num_attention_heads"])
    return config


def build(name: str, path: Path, *, seed: int = 0, head_dim: int | None = None) -> Path:
    """Write the family ``name``'s tiny model into ``path``; returns ``path``. ``head_dim``:
    wider attention heads than the default (for ``--kv-bits``)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    family = FAMILIES[name]
    template = _template(family)
    specials = _specials(family, template)
    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path, template, specials)
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    config = _set_vocab(family.config, len(vocab), vocab[family.eos], vocab["<|endoftext|>"])
    if head_dim is not None:
        config = _with_head_dim(config, head_dim)
    mx.random.seed(seed)
    model = _model_class(config)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    _write_tokenizer_config(path, family, template)
    return path


def _write_tokenizer_config(path: Path, family: Family, template: str) -> None:
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": family.bos,
        "eos_token": family.eos,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": template,
        "model_max_length": 4096,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))


def build_all(root: Path, names: list[str] | None = None) -> dict[str, Path]:
    """Every family (or ``names``) under ``root``, one directory each."""
    return {n: build(n, root / n) for n in (names or list(FAMILIES))}
