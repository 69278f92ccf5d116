"""Tiny random-weight vision-language models for mlx-vlm (Qwen2-VL, LLaVA), with their
processors' files written locally (no hub)."""

from __future__ import annotations

import json
from pathlib import Path

from tiny_model import TINY_LLAMA, build_tokenizer

SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# The Qwen2-VL chat template, reduced to what the tests need: text and image/video parts
# in any turn, tools, and the generation prompt.
TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'video' or 'video' in part %}"
    "{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if tools %}{{ '<|im_start|>system\nTools: ' + (tools | tojson) + '<|im_end|>\n' }}{% endif %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

PATCH = 14
MERGE = 2


def _tokenizer(
    path: Path, specials: list[str] = SPECIALS, template: str = TEMPLATE
) -> dict[str, int]:
    build_tokenizer(path, template, specials)
    (path / "chat_template.jinja").write_text(template)
    return json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]


def _processor_configs(path: Path, max_pixels: int) -> None:
    image = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "patch_size": PATCH,
        "temporal_patch_size": 2,
        "merge_size": MERGE,
        "min_pixels": (PATCH * MERGE) ** 2,
        "max_pixels": max_pixels,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True,
        "processor_class": "Qwen2VLProcessor",
    }
    (path / "preprocessor_config.json").write_text(json.dumps(image))
    (path / "video_preprocessor_config.json").write_text(json.dumps(image))
    (path / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}))


def build_tiny_vlm(path: Path, *, seed: int = 0, max_pixels: int = 224 * 224) -> Path:
    """Write config.json, model.safetensors, tokenizer and processor files into ``path``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models import qwen2_vl

    path.mkdir(parents=True, exist_ok=True)
    vocab = _tokenizer(path)
    _processor_configs(path, max_pixels)
    hidden, heads = 64, 4
    config = {
        "model_type": "qwen2_vl",
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "hidden_size": hidden,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": max(len(vocab), 64),
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        # head_dim 16: the three mRoPE sections split its 8 frequencies.
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        # Untied and sharpened: with tied random embeddings greedy decoding just repeats
        # the last input token, whatever the image.
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": vocab["<|im_end|>"],
        "image_token_id": vocab["<|image_pad|>"],
        "video_token_id": vocab["<|video_pad|>"],
        "vision_start_token_id": vocab["<|vision_start|>"],
        "vision_end_token_id": vocab["<|vision_end|>"],
        "vision_config": {
            "model_type": "qwen2_vl",
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": hidden,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": PATCH,
            "spatial_patch_size": PATCH,
            "spatial_merge_size": MERGE,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
    }
    mx.random.seed(seed)
    args = qwen2_vl.ModelConfig.from_dict(json.loads(json.dumps(config)))
    args.vision_config = qwen2_vl.VisionConfig.from_dict(config["vision_config"])
    args.text_config = qwen2_vl.TextConfig.from_dict(args.text_config)
    model = qwen2_vl.Model(args)
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        if name.endswith("patch_embed.proj.weight"):
            value = value.transpose(0, 4, 1, 2, 3)  # stored the PyTorch way, as checkpoints are
        elif name.endswith("lm_head.weight"):
            value = value * 4.0
        weights[name] = value
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config))
    return path


# Idefics3 (SmolVLM): "<image>" in the text, which the processor replaces with one
# "<fake_token_around_image><row_r_col_c>(<image> * image_seq_len)" block per tile and a
# global view; images are resized to 56 pixels on the longest side and cut into 28-pixel
# tiles, and each tile's 2x2 patches are shuffled into one token.
IDEFICS3_SPECIALS = [
    *SPECIALS[:3],
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
]
IDEFICS3_TEMPLATE = TEMPLATE.replace("'<|vision_start|><|image_pad|><|vision_end|>'", "'<image>'")
TILE = 28


def build_tiny_idefics3(path: Path, *, seed: int = 0) -> Path:
    """A tiny Idefics3 (SigLIP vision tower, pixel-shuffle connector, Llama) in ``path``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models import idefics3

    path.mkdir(parents=True, exist_ok=True)
    vocab = _tokenizer(path, IDEFICS3_SPECIALS, IDEFICS3_TEMPLATE)
    image = {
        "image_processor_type": "Idefics3ImageProcessor",
        "do_resize": True,
        "size": {"longest_edge": 2 * TILE},
        "max_image_size": {"longest_edge": TILE},
        "do_image_splitting": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_pad": True,
        "do_convert_rgb": True,
    }
    (path / "preprocessor_config.json").write_text(json.dumps(image))
    processor = {"processor_class": "Idefics3Processor", "image_seq_len": 1}
    (path / "processor_config.json").write_text(json.dumps(processor))
    text = {**TINY_LLAMA, "vocab_size": max(len(vocab), 64), "tie_word_embeddings": False}
    vision = {
        "model_type": "idefics3",
        "hidden_size": 32,
        "num_attention_heads": 2,
        "patch_size": PATCH,
        "num_hidden_layers": 1,
        "intermediate_size": 64,
        "image_size": TILE,
        "num_channels": 3,
    }
    config = {
        "model_type": "idefics3",
        "architectures": ["Idefics3ForConditionalGeneration"],
        "text_config": text,
        "vision_config": vision,
        "scale_factor": 2,
        "image_token_id": vocab["<image>"],
        "vocab_size": text["vocab_size"],
        "bos_token_id": None,
        "eos_token_id": vocab["<|im_end|>"],
    }
    mx.random.seed(seed)
    args = idefics3.ModelConfig.from_dict(json.loads(json.dumps(config)))
    args.text_config = idefics3.TextConfig.from_dict(text)
    args.vision_config = idefics3.VisionConfig.from_dict(vision)
    model = idefics3.Model(args)
    weights = {
        k: v * 4.0 if k.endswith("lm_head.weight") else v
        for k, v in tree_flatten(model.parameters())
    }
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config))
    return path
