"""Tiny random-weight vision-language models of the families people run, built in memory
with mlx-vlm's own classes (LLaVA, LLaVA-NeXT, Pixtral, Mistral 3, Qwen2.5-VL, Qwen3-VL),
each with the tests' tokenizer and hand-made inputs: a prompt with one image's tokens and
pixels of the shape the family's processor would give (no processor, no hub)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine_runner import request
from tiny_vlm import SPECIALS, _tokenizer

IMAGE = "<image>"  # the image placeholder of every family here (its id goes in the config)
EXTRA = ["<image>", "<image_break>", "<image_end>"]
HIDDEN = 64
SIDE = 28  # pixels on each side of an image (14-pixel patches: 2x2 of them)

TEXT = {  # the language model (Llama-like; the family's own class)
    "hidden_size": HIDDEN,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
CLIP = {
    "model_type": "clip_vision_model",
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "image_size": SIDE,
    "patch_size": 14,
    "projection_dim": 32,
}


@dataclass
class TinyVLM:
    """A tiny model, its tokenizer, and ``req(i)``: a request with picture ``i`` (0 or 1)."""

    family: str
    model: Any
    tokenizer: Any
    req: Callable[..., Any]
    text_prompt: list[int]


def _llava_like(mod: Any, vocab: int, image: int) -> Any:
    """LLaVA and LLaVA-NeXT (CLIP and Llama), Pixtral and Mistral 3 (Pixtral's tower, Mistral)."""
    family = mod.__name__.rsplit(".", 1)[-1]
    if family.startswith("llava"):
        text, vision = dict(TEXT, model_type="llama"), CLIP
    else:
        text = dict(TEXT, model_type="mistral", head_dim=16)
        vision = dict(CLIP, model_type="pixtral", num_hidden_layers=1, head_dim=16)
        vision["image_size"] = 2 * SIDE
    config = mod.ModelConfig(
        text_config=mod.TextConfig.from_dict(dict(text, vocab_size=vocab)),
        vision_config=mod.VisionConfig.from_dict(vision),
        model_type=family,
        image_token_index=image,
        vocab_size=vocab,
    )
    return mod.Model(config)


def _qwen(mod: Any, vocab: int, image: int, ids: dict[str, int]) -> Any:
    family = mod.__name__.rsplit(".", 1)[-1]
    text = dict(TEXT, model_type=family, vocab_size=vocab)
    text["rope_scaling"] = {"type": "mrope", "mrope_section": [2, 3, 3]}  # head_dim 16
    vision: dict[str, Any] = {
        "model_type": family,
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "out_hidden_size": HIDDEN,
        "num_heads": 2,
        "patch_size": 14,
        "spatial_patch_size": 14,
        "window_size": 56,
        "fullatt_block_indexes": [0],
    }
    if family == "qwen3_vl":
        text.update(head_dim=16, rope_scaling={"type": "default", "mrope_section": [2, 3, 3]})
        vision.update(num_position_embeddings=16, deepstack_visual_indexes=[0])
    config = mod.ModelConfig(
        text_config=mod.TextConfig.from_dict(text),
        vision_config=mod.VisionConfig.from_dict(vision),
        model_type=family,
        image_token_id=image,
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        vocab_size=vocab,
    )
    return mod.Model(config)


FAMILIES = ["llava", "llava_next", "pixtral", "mistral3", "qwen2_5_vl", "qwen3_vl"]


def build(family: str, path: Path, seed: int = 0) -> TinyVLM:
    """The tiny ``family`` model (tokenizer files written into ``path``)."""
    import importlib

    import mlx.core as mx
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlx_server.models.base import settle_arrays

    vocab = _tokenizer(path, [*SPECIALS, *EXTRA])
    tok = load_tokenizer(path, eos_token_ids=[vocab["<|im_end|>"]])
    size = max(len(vocab), 64)
    mod = importlib.import_module(f"mlx_vlm.models.{family}")
    mx.random.seed(seed)
    image = vocab[IMAGE]
    qwen = family.startswith("qwen")
    if qwen:
        model = _qwen(mod, size, image, vocab)
    else:
        model = _llava_like(mod, size, image)
    head = model.language_model.lm_head
    head.weight = head.weight * 4  # sharper than random: the outputs depend on the input
    settle_arrays(model)  # as the loader does: the engine thread runs it

    n, pixels, extra = _pixels(family)
    ids = tok.encode("<|im_start|>user\n", add_special_tokens=False)
    if qwen:
        ids += [vocab["<|vision_start|>"], *[image] * n, vocab["<|vision_end|>"]]
    else:
        ids += [image] * n
    ids += tok.encode("What is this?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    mask = mx.ones((1, len(ids)), dtype=mx.int32)
    mx.eval(pixels, mask, extra)  # made here, used on the engine threads

    def req(i: int, n_tokens: int = 5, **kw: Any) -> Any:
        key = [-1 - i if t == image else t for t in ids]  # as media_key would, per picture
        inputs = {"pixel_values": pixels[i], "attention_mask": mask, **extra}
        kw = {"ignore_eos": True, "logprobs": True, **kw}
        return request(ids, n_tokens, vision_inputs=inputs, cache_tokens=key, **kw)

    text = tok.encode("<|im_start|>user\nHi<|im_end|>\n", add_special_tokens=False)
    return TinyVLM(family, model, tok, req, text)


def _pixels(family: str) -> tuple[int, list[Any], dict[str, Any]]:
    """(image tokens in the prompt, two pictures' pixel values, other vision inputs)."""
    import mlx.core as mx

    if family == "llava":  # CLIP: 2x2 patches, the class token dropped
        return 4, [mx.random.normal((1, 3, SIDE, SIDE)) for _ in range(2)], {}
    if family == "llava_next":  # anyres: one placeholder; tiles' features and a newline row
        return 1, [mx.random.normal((1, 2, 3, SIDE, SIDE)) for _ in range(2)], {}
    if family == "pixtral":  # 2x2 patches of 14 pixels
        sizes = mx.array([[SIDE, SIDE]])
        return 4, [mx.random.normal((1, 3, SIDE, SIDE)) for _ in range(2)], {"image_sizes": sizes}
    if family == "mistral3":  # 4x4 patches, merged 2x2 into one token each
        sizes = mx.array([[2 * SIDE, 2 * SIDE]])
        side = 2 * SIDE
        return 4, [mx.random.normal((1, 3, side, side)) for _ in range(2)], {"image_sizes": sizes}
    # Qwen-VL: 4x4 patches of 2 frames x 14 x 14 x 3, merged 2x2 into 4 tokens
    grid = mx.array([[1, 4, 4]])
    return 4, [mx.random.normal((16, 3 * 2 * 14 * 14)) for _ in range(2)], {"image_grid_thw": grid}
