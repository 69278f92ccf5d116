"""Build a tiny random-weight Qwen2-VL model for mlx-vlm, with a local processor (no hub)."""

from __future__ import annotations

import json
from pathlib import Path

from tiny_model import CORPUS

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


def _tokenizer(path: Path) -> dict[str, int]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": TEMPLATE,
        "model_max_length": 4096,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (path / "chat_template.jinja").write_text(TEMPLATE)
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
