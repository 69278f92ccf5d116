"""The memory a vision tower takes while it encodes a request's media, counted at admission.

The tower runs as a request with media starts (``VisionPrefill``, or mlx-vlm's
``generate_step`` one request at a time), beside the KV of every running sequence; its
activations are gone once the prompt's embeddings are made. So the scheduler counts them for
that request at admission only: a request whose KV and tower cannot fit the budget even
alone is refused, and one that cannot fit beside the running ones waits for them
(``Scheduler``). The count is an estimate from the media's size and the tower's shape, high
rather than low::

    patches x (hidden x (layers + 16) + 2 x intermediate + 2 x heads x patches per image)
    x 4 bytes + the pixel values themselves

- patches: the pixel values' elements over channels x patch size² (x the temporal patch of
  Qwen-VL's towers): every tile of every image and every frame of every video, as the
  processor made them;
- hidden x layers: towers keep each layer's hidden states (SigLIP and Idefics3 hand them all
  back, Qwen3-VL's deepstack keeps some), and a few more for the projector and the features;
- intermediate: the MLP's activations; heads x patches per image: the attention scores and
  their softmax where attention is not fused (each image attends within itself; MLX's CPU
  backend materializes them, its GPU kernels mostly do not, where this term is high);
- 4 bytes: float32 activations, the widest a tower computes in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlx_server.types import GenerationRequest

_ACTIVATION_BYTES = 4
_PIXELS = ("pixel_values", "pixel_values_videos")  # images; Qwen-VL's videos
_EXTRA_STATES = 16  # hidden-size activations besides one per layer (embeddings, projector)


def _get(config: Any, *names: str, default: float = 0) -> float:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int | float) and value > 0:
            return float(value)
    return float(default)


def _elements(x: Any) -> tuple[int, int]:
    """Elements and images (leading entries) of pixel values: an array or a list of them."""
    if isinstance(x, list | tuple):
        parts = [_elements(p) for p in x]
        return sum(p[0] for p in parts), sum(p[1] for p in parts)
    shape = tuple(getattr(x, "shape", ()))
    size = 1
    for n in shape:
        size *= int(n)
    images = 1
    if len(shape) >= 4:  # (images, channels, height, width), (batch, images, c, h, w)
        for n in shape[:-3]:
            images *= int(n)
    return size, images


def tower_bytes(vlm: Any, inputs: dict[str, Any] | None) -> int:
    """Bytes the vision tower may hold while it encodes ``inputs`` (0 without pixels)."""
    inputs = inputs or {}
    pixels = [inputs[k] for k in _PIXELS if inputs.get(k) is not None]
    if not pixels:
        return 0
    tower = getattr(getattr(vlm, "config", None), "vision_config", None)
    size, images = _elements(pixels)
    # Qwen-VL: flat patches, one row of each grid's (t, h, w) per image or video.
    grids = [inputs.get(k) for k in ("image_grid_thw", "video_grid_thw")]
    counted = sum(int(g.shape[0]) for g in grids if g is not None and len(g.shape) == 2)
    images = max(images, counted, 1)
    channels = _get(tower, "num_channels", "in_channels", "in_chans", default=3)
    patch = _get(tower, "patch_size", "spatial_patch_size", default=14)
    temporal = _get(tower, "temporal_patch_size", default=1)
    hidden = _get(tower, "embed_dim", "hidden_size", default=1024)  # Qwen2-VL: embed_dim
    layers = _get(tower, "num_hidden_layers", "depth", default=32)
    mlp = _get(tower, "intermediate_size", default=_get(tower, "mlp_ratio", default=4) * hidden)
    heads = _get(tower, "num_attention_heads", "num_heads", default=16)
    if _embedder_only(vlm, tower):
        # Gemma 4 unified: each row of pixel values (a model patch) projected to one
        # embedding, no layers, no attention (its config has no depth; mlx-vlm's
        # ``vision_embedder``): counted as a tower of 32 layers it came to 2.8 GiB an image
        patch = _get(tower, "model_patch_size", default=patch)
        layers, heads, mlp = 0.0, 0.0, hidden
    patches = max(1.0, size / (channels * patch * patch * temporal))
    per_patch = hidden * (layers + _EXTRA_STATES) + 2 * mlp + 2 * heads * patches / images
    return int(patches * per_patch * _ACTIVATION_BYTES) + size * _ACTIVATION_BYTES


def _embedder_only(vlm: Any, tower: Any) -> bool:
    """Whether the model's "tower" is a projection of patches without layers: no depth in
    its config and no tower module (``vision_tower``, ``vision_model``) on the model."""
    if _get(tower, "num_hidden_layers", "depth"):
        return False
    return all(getattr(vlm, name, None) is None for name in ("vision_tower", "vision_model"))


def media_bytes(vlm: Any) -> Callable[[GenerationRequest], int]:
    """The scheduler's count of a request's tower memory (``EngineConfig.media_bytes``)."""
    return lambda req: tower_bytes(vlm, req.vision_inputs)
