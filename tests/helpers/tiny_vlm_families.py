"""Tiny random-weight vision-language models of the families people run, built in memory
with mlx-vlm's own classes (LLaVA, LLaVA-NeXT, Pixtral, Mistral 3, Qwen2.5-VL, Qwen3-VL,
Gemma 4 as E2B/E4B are made and as 26B/31B let an image's tokens see each other, Gemma 4
unified with its encoder-free patch embedder, Gemma 3n with a stand-in for its fixed-size
tower), each with the tests' tokenizer and hand-made
inputs: a prompt with one image's tokens (after a system prompt or not) or with two images'
(text between them), pixels of the shape the family's processor would give, and its token
types where its processor gives them (no processor, no hub)."""

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
    """A tiny model, its tokenizer, ``req(i)``: a request with picture ``i`` (0 or 1), and
    ``req2(i, j)``: one with pictures ``i`` and ``j`` in that order, text between them;
    ``system``: a system prompt's tokens (``req(i, with_system=True)`` opens with it)."""

    family: str
    model: Any
    tokenizer: Any
    req: Callable[..., Any]
    req2: Callable[..., Any]
    text_prompt: list[int]
    system: list[int]


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


def _gemma4_text(vocab: int) -> dict[str, Any]:
    """The tiny Gemma 4 language model both Gemma 4 families here share: four layers,
    sliding-window (8) and full ones in turn, the full ones with heads twice as wide."""
    return {
        "hidden_size": HIDDEN,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "head_dim": 16,
        "global_head_dim": 32,
        "num_key_value_heads": 2,
        "vocab_size": vocab,
        "vocab_size_per_layer_input": vocab,
        "sliding_window": 8,
        "sliding_window_pattern": 2,
        "max_position_embeddings": 4096,
    }


def _gemma4(mod: Any, vocab: int, ids: dict[str, int], bidirectional: bool) -> Any:
    """Gemma 4 as its E2B/E4B checkpoints are made: per-layer inputs, sliding-window and full
    layers (the full ones with partial RoPE), the last two layers sharing the KV of the
    first two; its own vision tower (4-pixel patches, pooled 2x2 into one token). The
    26B-A4B and 31B let an image's tokens see each other (``bidirectional``)."""
    text = mod.TextConfig(
        model_type="gemma4_text",
        **_gemma4_text(vocab),
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=8,
        use_bidirectional_attention="vision" if bidirectional else None,
        rope_parameters={
            "full_attention": {
                "partial_rotary_factor": 0.25,
                "rope_theta": 1000000.0,
                "rope_type": "proportional",
            },
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
    )
    vision = mod.VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=16,
        patch_size=4,
        position_embedding_size=16,
        pooling_kernel_size=2,
        default_output_length=9,
    )
    config = mod.ModelConfig(
        text_config=text,
        vision_config=vision,
        model_type="gemma4",
        vocab_size=vocab,
        image_token_id=ids[IMAGE],
        boi_token_id=ids["<image_break>"],
        eoi_token_id=ids["<image_end>"],
        hidden_size=HIDDEN,
    )
    return mod.Model(config)


# Gemma 4 unified's patches (pixels on a side) and rows per image (its soft tokens: the
# processor pads every image's patches to as many, the positions of the padding -1).
G4U_PATCH = 4
G4U_ROWS = 6


def _gemma4_unified(mod: Any, vocab: int, ids: dict[str, int]) -> Any:
    """Gemma 4 unified (the 12B's family): Gemma 4's language model with its config's
    defaults, no per-layer inputs nor KV-shared layers, keys as values on its full layers
    (one KV head there), an image's tokens seeing each other; no vision tower, but an
    embedder of the processor's patches (one soft token each) and their positions (rows of
    -1 past an image's patches, as the processor pads them)."""
    import mlx.core as mx

    text = mod.TextConfig(**_gemma4_text(vocab), num_global_key_value_heads=1)
    vision = mod.VisionConfig(
        patch_size=4,
        pooling_kernel_size=3,
        model_patch_size=G4U_PATCH,
        mm_embed_dim=32,
        output_proj_dims=32,
        mm_posemb_size=16,
        num_soft_tokens=G4U_ROWS,
    )
    config = mod.ModelConfig(
        text_config=text,
        vision_config=vision,
        audio_config=None,
        vocab_size=vocab,
        image_token_id=ids[IMAGE],
        boi_token_id=ids["<image_break>"],
        eoi_token_id=ids["<image_end>"],
        hidden_size=HIDDEN,
    )
    model = mod.Model(config)
    # The checkpoints' patch positions are learned; mlx-vlm's zeros would leave them unused.
    embedder = model.vision_embedder
    embedder.pos_embedding = mx.random.normal(embedder.pos_embedding.shape)
    return model


# Gemma 3n's hard multimodal tokens: 16 ids past the tokenizer's (whose tokens alone have
# per-layer inputs), 8 for the vision embedder (the end of an image, the image token, ...)
# and 8 for audio's, as its checkpoints put them past the text's.
G3N_MEDIA = 16


def _gemma3n(mod: Any, text_vocab: int) -> Any:
    """Gemma 3n: per-layer inputs, AltUp and Laurel blocks, sliding-window and full layers,
    the last two sharing the KV of the first two, activation sparsity on the first. mlx-vlm
    builds its vision tower (MobileNet-v5) at one size only, 294 M parameters, too slow for
    the CPU: a 4-pixel-patch convolution stands in for it, with its output's layout (the
    tower runs the same alone and batched; the embedder after it is mlx-vlm's)."""
    import mlx.nn as nn

    vocab = text_vocab + G3N_MEDIA
    text = mod.TextConfig(
        model_type="gemma3n_text",
        hidden_size=HIDDEN,
        num_hidden_layers=4,
        intermediate_size=[128] * 4,
        num_attention_heads=4,
        head_dim=16,
        num_key_value_heads=2,
        vocab_size=vocab,
        vocab_size_per_layer_input=text_vocab,
        laurel_rank=8,
        hidden_size_per_layer_input=8,
        sliding_window=8,
        num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 2,
        activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
    )
    vision = mod.VisionConfig(hidden_size=32, vocab_size=8, vocab_offset=text_vocab)
    audio = mod.AudioConfig(
        hidden_size=32,
        vocab_size=8,
        vocab_offset=text_vocab + 8,
        conf_num_hidden_layers=1,
        conf_num_attention_heads=2,
        sscp_conv_channel_size=(8, 4),
        input_feat_size=16,
    )
    config = mod.ModelConfig(
        text_config=text,
        vision_config=vision,
        audio_config=audio,
        model_type="gemma3n",
        vocab_size=vocab,
        image_token_id=text_vocab + 1,
        image_token_index=text_vocab + 1,
        audio_token_id=text_vocab + 9,
        hidden_size=HIDDEN,
        vision_soft_tokens_per_image=4,
    )
    model = mod.Model(config)

    class Tower(nn.Module):  # pixels (B, 3, 8, 8) -> (B, 2, 2, 32), as the tower's layout
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 32, kernel_size=4, stride=4)

        def __call__(self, x: Any, output_hidden_states: Any = None) -> Any:
            return self.conv(x.transpose(0, 2, 3, 1))

    model.vision_tower = Tower()
    return model


FAMILIES = [
    "llava",
    "llava_next",
    "pixtral",
    "mistral3",
    "qwen2_5_vl",
    "qwen3_vl",
    "gemma4",
    "gemma4_unified",
    "gemma3n",
]
# Variants of a family: (the family's module, whether an image's tokens see each other).
VARIANTS = {"gemma4_bidirectional": ("gemma4", True)}


def build(family: str, path: Path, seed: int = 0) -> TinyVLM:
    """The tiny ``family`` model (tokenizer files written into ``path``)."""
    import importlib

    import mlx.core as mx
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlx_server.models.base import settle_arrays

    vocab = _tokenizer(path, [*SPECIALS, *EXTRA])
    tok = load_tokenizer(path, eos_token_ids=[vocab["<|im_end|>"]])
    size = max(len(vocab), 64)
    module, bidirectional = VARIANTS.get(family, (family, False))
    mod = importlib.import_module(f"mlx_vlm.models.{module}")
    mx.random.seed(seed)
    image = vocab[IMAGE]
    qwen = family.startswith("qwen")
    gemma4 = module.startswith("gemma4")  # Gemma 4 and Gemma 4 unified
    if qwen:
        model = _qwen(mod, size, image, vocab)
    elif module == "gemma4_unified":
        model = _gemma4_unified(mod, size, vocab)
    elif gemma4:  # tied embeddings, logits soft-capped: spread enough as they are
        model = _gemma4(mod, size, vocab, bidirectional)
    elif module == "gemma3n":  # the same; its image token is a hard multimodal one
        model = _gemma3n(mod, size)
        image = size + 1
    else:
        model = _llava_like(mod, size, image)
    if not (gemma4 or module == "gemma3n"):
        head = model.language_model.lm_head
        head.weight = head.weight * 4  # sharper than random: the outputs depend on the input
    settle_arrays(model)  # as the loader does: the engine thread runs it

    n, pixels, extra = _pixels(module)
    if qwen:
        picture = [vocab["<|vision_start|>"], *[image] * n, vocab["<|vision_end|>"]]
    elif gemma4:  # the start of an image, its soft tokens, its end (as its processor writes)
        picture = [vocab["<image_break>"], *[image] * n, vocab["<image_end>"]]
    elif module == "gemma3n":  # its end of image is the vision embedder's first hard token
        picture = [vocab["<image_break>"], *[image] * n, size]
    else:
        picture = [image] * n

    def text(s: str) -> list[int]:
        return list(tok.encode(s, add_special_tokens=False))

    user, answer = text("<|im_start|>user\n"), text("<|im_end|>\n<|im_start|>assistant\n")
    ids = user + picture + text("What is this?") + answer
    ids2 = user + picture + text("Then this:") + picture + text("What differs?") + answer
    system = text("<|im_start|>system\nYou describe pictures.<|im_end|>\n")
    # Without and with the system prompt, one picture or two.
    prompts = {
        (images, with_system): (system if with_system else []) + prompt
        for images, prompt in ((1, ids), (2, ids2))
        for with_system in (False, True)
    }
    # Two pictures as the family's processor gives them: a batch of images (LLaVA, Pixtral,
    # Mistral 3, Gemma 4) or Qwen-VL's patches one after the other, and a row each of
    # ``image_sizes`` / ``image_grid_thw`` (every picture here the same size).
    extra2 = {k: mx.concatenate([v, v]) for k, v in extra.items()}
    inputs: dict[tuple[int, bool], dict[str, Any]] = {}
    for (images, with_system), prompt in prompts.items():
        mask = mx.ones((1, len(prompt)), dtype=mx.int32)
        inputs[images, with_system] = {"attention_mask": mask, **(extra2 if images == 2 else extra)}
        if module.startswith("gemma"):  # as their processors give them: 1 at each image token
            types = (mx.array([prompt]) == image).astype(mx.int32)
            name = "mm_token_type_ids" if gemma4 else "token_type_ids"
            inputs[images, with_system][name] = types
    mx.eval(pixels, inputs)  # made here, used on the engine threads

    def keyed(prompt: list[int], marks: list[int]) -> list[int]:
        """The prompt with its r-th run of image tokens as ``marks[r]`` (as ``media_key``
        keys them: the r-th run by the first r + 1 pictures)."""
        key, run = list(prompt), -1
        for k, t in enumerate(prompt):
            if t == image:
                if k == 0 or prompt[k - 1] != image:
                    run += 1
                key[k] = marks[run]
        return key

    def req(i: int, n_tokens: int = 5, *, with_system: bool = False, **kw: Any) -> Any:
        """A request with picture ``i``, after the system prompt ``with_system``."""
        prompt = prompts[1, with_system]
        key = keyed(prompt, [-1 - i])  # as media_key would, per picture
        kw = {"ignore_eos": True, "logprobs": True, **kw}
        if with_system:
            kw.setdefault("system_prefix_tokens", len(system))
        vision = {"pixel_values": pixels[i], **inputs[1, with_system]}
        return request(prompt, n_tokens, vision_inputs=vision, cache_tokens=key, **kw)

    def req2(i: int, j: int, n_tokens: int = 5, *, with_system: bool = False, **kw: Any) -> Any:
        """A request with pictures ``i`` then ``j``, text between them, after the system
        prompt ``with_system``. The first picture's tokens are keyed as ``req(i)`` keys them
        (the same first image, the same prefix), the second's by both pictures."""
        prompt = prompts[2, with_system]
        key = keyed(prompt, [-1 - i, -3 - 2 * i - j])
        kw = {"ignore_eos": True, "logprobs": True, **kw}
        if with_system:
            kw.setdefault("system_prefix_tokens", len(system))
        both = mx.concatenate([pixels[i], pixels[j]])
        mx.eval(both)  # made here, used on the engine threads
        vision = {"pixel_values": both, **inputs[2, with_system]}
        return request(prompt, n_tokens, vision_inputs=vision, cache_tokens=key, **kw)

    hi = text("<|im_start|>user\nHi<|im_end|>\n")
    return TinyVLM(family, model, tok, req, req2, hi, system)


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
    if family == "gemma3n":  # the stand-in tower: 2x2 patches of 4 pixels
        return 4, [mx.random.normal((1, 3, 8, 8)) for _ in range(2)], {}
    if family == "gemma4":  # 6x6 patches of 4 pixels, pooled 2x2 into 9 tokens
        return 9, [mx.random.normal((1, 3, 24, 24)) for _ in range(2)], {}
    if family == "gemma4_unified":  # 2x2 patches, a token each, padded to G4U_ROWS rows
        side, dim = 2, 3 * G4U_PATCH * G4U_PATCH
        n = side * side
        pad = mx.zeros((1, G4U_ROWS - n, dim))
        pixels = [mx.concatenate([mx.random.normal((1, n, dim)), pad], axis=1) for _ in range(2)]
        grid = [[x, y] for y in range(side) for x in range(side)]  # (x, y), x fastest
        where = mx.array([grid + [[-1, -1]] * (G4U_ROWS - n)])
        return n, pixels, {"image_position_ids": where}
    # Qwen-VL: 4x4 patches of 2 frames x 14 x 14 x 3, merged 2x2 into 4 tokens
    grid = mx.array([[1, 4, 4]])
    return 4, [mx.random.normal((16, 3 * 2 * 14 * 14)) for _ in range(2)], {"image_grid_thw": grid}
