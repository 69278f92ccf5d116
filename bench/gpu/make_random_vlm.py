#!/usr/bin/env python3
"""A random-weight vision-language model of a real shape, built with mlx-vlm's own classes, and
its text twin, for speed measurements only (bench_vision.py, vision.sh).

Usage: make_random_vlm.py OUT_DIR PRESET BITS TOKENIZER_DIR [--text TWIN_DIR]
  PRESET: qwen25vl-7b  Qwen2.5-VL-7B-Instruct's shape (language model 28 layers of 3,584, 28 heads
                       over 4 KV heads; vision tower 32 blocks of 1,280, windowed attention, 2x2
                       patch merger); tiny-qwen25vl: the same code paths scaled down, for a CPU.
  BITS: 0 = bfloat16, 4 = the language model 4-bit affine (group 64), the vision tower in bfloat16.
  TOKENIZER_DIR: the kit's tokenizer (SmolLM2's); Qwen-VL's vision tokens are added to it, and the
  chat template is Qwen-VL's (ChatML with <|vision_start|><|image_pad|><|vision_end|> per image).
  --text TWIN_DIR: also write the same language model, the same weights, as a plain mlx-lm qwen2
  model: the text path's speed on the same network, for the text-only request's ratio.
Speed does not depend on weight values; answers are noise, so benchmarks must not stop on EOS early.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
from pathlib import Path

from make_random_model import copy_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# Qwen-VL's ChatML, with each image (OpenAI's image_url parts, or mlx-vlm's image parts) as its
# vision tokens.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p.type == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen/Qwen2.5-VL-7B-Instruct config.json, less the vocabulary (the kit's tokenizer's).
QWEN25VL_7B = {
    "text": {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    },
    "vision": {
        "depth": 32,
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "out_hidden_size": 3584,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
    },
}
TINY = {
    "text": {
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},  # head_dim 32
    },
    "vision": {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "out_hidden_size": 128,
        "window_size": 112,
        "fullatt_block_indexes": [1],
    },
}
PRESETS = {"qwen25vl-7b": QWEN25VL_7B, "tiny-qwen25vl": TINY}
PATCH, MERGE, TEMPORAL = 14, 2, 2


def tokenizer(src: Path, out: Path) -> dict[str, int]:
    """The kit's tokenizer with Qwen-VL's vision tokens and template; the ids of the new tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    tok.add_special_tokens(VISION_TOKENS)
    tok.save(str(out / "tokenizer.json"))
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg.pop("added_tokens_decoder", None)  # rebuilt from tokenizer.json
    cfg.update(chat_template=TEMPLATE, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    (out / "chat_template.jinja").write_text(TEMPLATE)
    if (src / "special_tokens_map.json").exists():
        shutil.copy(src / "special_tokens_map.json", out / "special_tokens_map.json")
    return {t: tok.token_to_id(t) for t in [*VISION_TOKENS, "<|im_end|>"]}


def processor_files(out: Path) -> None:
    image = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "patch_size": PATCH,
        "temporal_patch_size": TEMPORAL,
        "merge_size": MERGE,
        "min_pixels": 56 * 56,
        "max_pixels": 1280 * 28 * 28,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_convert_rgb": True,
        "processor_class": "Qwen2_5_VLProcessor",
    }
    (out / "preprocessor_config.json").write_text(json.dumps(image, indent=1))
    processor = {"processor_class": "Qwen2_5_VLProcessor"}
    (out / "processor_config.json").write_text(json.dumps(processor))


def vlm_config(preset: str, ids: dict[str, int]) -> dict:
    shape = copy.deepcopy(PRESETS[preset])
    vocab = -(-(max(ids.values()) + 1) // 64) * 64  # the tokenizer's, rounded up as checkpoints do
    return {
        "model_type": "qwen2_5_vl",
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        **shape["text"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 128000,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": ids["<|im_end|>"],
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_config": {
            "model_type": "qwen2_5_vl",
            **shape["vision"],
            "patch_size": PATCH,
            "spatial_patch_size": PATCH,
            "spatial_merge_size": MERGE,
            "temporal_patch_size": TEMPORAL,
            "tokens_per_second": 2,
            "in_channels": 3,
        },
    }


def build(config: dict):
    """The model with weights drawn small and lazily (computed shard by shard as they are saved)."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_vlm.models import qwen2_5_vl

    args = qwen2_5_vl.ModelConfig.from_dict(json.loads(json.dumps(config)))
    args.vision_config = qwen2_5_vl.VisionConfig.from_dict(config["vision_config"])
    args.text_config = qwen2_5_vl.TextConfig.from_dict(args.text_config)
    model = qwen2_5_vl.Model(args)
    draw = lambda p: mx.random.normal(p.shape, dtype=mx.bfloat16, scale=0.02)  # noqa: E731
    model.update(tree_map(draw, model.parameters()))
    return model


def quantize_language_model(model, config: dict, bits: int) -> dict:
    """The language model's linear layers (and embedding) in ``bits``; mlx-vlm's loader quantizes
    the layers whose ``scales`` are in the checkpoint, so the vision tower stays in bfloat16."""
    import mlx.nn as nn

    def fits(path: str, m) -> bool:
        return hasattr(m, "to_quantized") and m.weight.shape[-1] % 64 == 0

    nn.quantize(model.language_model, group_size=64, bits=bits, class_predicate=fits)
    return {**config, "quantization": {"group_size": 64, "bits": bits}}


def save(model, config: dict, out: Path) -> dict:
    """Weights in checkpoint layout (the patch embedding as PyTorch stores it), config.json."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    weights = dict(tree_flatten(model.parameters()))
    for name, value in list(weights.items()):
        if name.endswith("patch_embed.proj.weight"):
            weights[name] = value.transpose(0, 4, 1, 2, 3)
    lm = {k: v for k, v in weights.items() if k.startswith("language_model.")}
    rest = {k: v for k, v in weights.items() if k not in lm}
    mx.save_safetensors(str(out / "model-00001-of-00002.safetensors"), rest)
    mx.save_safetensors(str(out / "model-00002-of-00002.safetensors"), lm)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return lm


def text_twin(lm_weights: dict, config: dict, tok_dir: Path, out: Path) -> None:
    """The language model alone as mlx-lm's qwen2: the same weights under mlx-lm's names."""
    import mlx.core as mx

    out.mkdir(parents=True, exist_ok=True)
    weights = {k.removeprefix("language_model."): v for k, v in lm_weights.items()}
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    keep = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
    keep += ["num_key_value_heads", "rms_norm_eps", "rope_theta", "max_position_embeddings"]
    keep += ["vocab_size", "tie_word_embeddings", "eos_token_id", "quantization"]
    text = {k: config[k] for k in keep if k in config}
    text.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    (out / "config.json").write_text(json.dumps(text, indent=1))
    copy_tokenizer(tok_dir, out)


def main(argv: list[str]) -> None:
    import mlx.core as mx

    out, preset, bits, tok = Path(argv[0]), argv[1], int(argv[2]), Path(argv[3])
    twin = Path(argv[argv.index("--text") + 1]) if "--text" in argv else None
    if preset not in PRESETS:
        raise SystemExit(f"unknown preset {preset!r}; one of {', '.join(PRESETS)}")
    out.mkdir(parents=True, exist_ok=True)
    ids = tokenizer(tok, out)
    processor_files(out)
    config = vlm_config(preset, ids)
    mx.random.seed(0)
    model = build(config)
    if bits:
        config = quantize_language_model(model, config, bits)
    lm = save(model, config, out)
    if twin is not None:
        text_twin(lm, config, out, twin)
    print(json.dumps({"model": str(out), "text_twin": str(twin), "preset": preset, "bits": bits}))


if __name__ == "__main__":
    main(sys.argv[1:])
