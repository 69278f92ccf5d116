"""What both model loaders (text: ``loader``, vision: ``vision``) share: the loaded-model
record, the load error, the KV-size estimate and the chat-template lookup."""

from __future__ import annotations

import json
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ModelLoadError(Exception):
    """The model could not be found or loaded; the message says why."""


@dataclass
class LoadedModel:
    """A loaded model with what the server needs to know about it."""

    model_id: str
    path: Path
    model: Any
    tokenizer: Any  # mlx_lm.tokenizer_utils.TokenizerWrapper
    config: dict[str, Any]
    capabilities: list[str] = field(default_factory=list)
    processor: Any = None  # a vision-language model's processor (mlx-vlm), else None

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.config, activation_bytes(self.model))


# What a module may hold that is no state of its own: classes, modules, functions.
_NOT_WALKED = (type, types.ModuleType, types.FunctionType, types.MethodType)


def settle_arrays(model: Any) -> int:
    """Evaluate every array the model's modules hold, parameters or not, on this thread.

    Some modules keep arrays that are not parameters and are built lazily while loading
    (mlx-lm's ``Llama3RoPE``, ``YarnRoPE``, ``SuScaledRoPE`` keep a ``_freqs``): left as a
    graph, they are computed on first use, on the engine thread, against a stream of the
    loading thread that the engine thread does not have ("There is no Stream(gpu, 0) in
    current thread"). Returns how many such arrays were evaluated."""
    import mlx.core as mx
    import mlx.nn as nn

    found: list[Any] = []
    seen: set[int] = set()  # plain objects already walked (they may refer to each other)

    def collect(value: Any, depth: int = 0) -> None:
        if isinstance(value, mx.array):
            found.append(value)
        elif depth >= 3 or isinstance(value, nn.Module):
            return  # modules are walked by ``modules()``
        elif isinstance(value, list | tuple):
            for v in value:
                collect(v, depth + 1)
        elif isinstance(value, dict):
            for v in value.values():
                collect(v, depth + 1)
        elif (
            hasattr(value, "__dict__")
            and not isinstance(value, _NOT_WALKED)
            and id(value) not in seen
        ):
            # A plain object a module holds (Pixtral's ``PixtralRotaryEmbedding`` keeps its
            # ``inv_freq`` so): its attributes, once.
            seen.add(id(value))
            for v in vars(value).values():
                collect(v, depth + 1)

    modules = model.modules() if isinstance(model, nn.Module) else []
    for module in modules:
        # Both kinds of attribute: those the module stores as its items (arrays whose names
        # start with "_" are items too, left out of ``parameters()``) and plain ones.
        for value in [*module.values(), *vars(module).values()]:
            if not isinstance(value, nn.Module):
                collect(value)
    mx.eval(model.parameters() if isinstance(model, nn.Module) else [], found)
    return len(found)


def activation_bytes(model: Any) -> int:
    """Bytes per element of the model's activations (and so of its KV cache): the dtype of
    its norm weights, which stay in float when the linear layers are quantized."""
    try:
        from mlx.utils import tree_flatten

        params: Any = tree_flatten(model.parameters())
        for name, value in params:
            if name.endswith("norm.weight"):
                return int(value.dtype.size)
    except Exception:
        pass
    return 2


def kv_bytes_per_token(
    config: dict[str, Any], elem_bytes: int = 2, bits: int | None = None, group_size: int = 64
) -> int:
    """KV-cache bytes one token costs, estimated from the model config; with ``bits``, for a
    quantized KV cache (packed values plus a scale and a bias per group)."""
    cfg = config.get("text_config", config)
    layers = int(cfg.get("num_hidden_layers", 0) or 0)
    heads = int(cfg.get("num_attention_heads", 1) or 1)
    kv_heads = int(cfg.get("num_key_value_heads", heads) or heads)
    hidden = int(cfg.get("hidden_size", 0) or 0)
    head_dim = int(cfg.get("head_dim", 0) or (hidden // heads if heads else 0))
    elements = 2 * layers * kv_heads * head_dim
    if bits:
        return max(1, round(elements * (bits / 8 + 2 * elem_bytes / group_size)))
    return max(1, elements * elem_bytes)


# Where configs state the longest sequence the model was trained on (Llama/Qwen/Mistral,
# GPT-2, MPT/Falcon, ChatGLM/Baichuan), in the order they are looked up.
_TRAINED_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


def trained_context(config: dict[str, Any]) -> int | None:
    """The model's trained maximum context from its config (a VLM's ``text_config`` first),
    or None when the config does not say."""
    for cfg in (config.get("text_config"), config):
        if not isinstance(cfg, dict):
            continue
        for key in _TRAINED_CONTEXT_KEYS:
            value = cfg.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def read_chat_template(model_dir: Path) -> str | dict[str, str] | None:
    """Chat template: chat_template.jinja, else chat_template.json, else tokenizer_config.json.

    Named templates (a list of ``{"name", "template"}``: Hermes 3, Command R ship ``default``
    and ``tool_use``) come back as a dict, so the request's tools can choose between them."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        f = model_dir / name
        if not f.is_file():
            continue
        try:
            tpl = json.loads(f.read_text(encoding="utf-8")).get("chat_template")
        except (OSError, ValueError):
            continue
        if isinstance(tpl, list):
            named = {
                t["name"]: t["template"]
                for t in tpl
                if isinstance(t, dict) and isinstance(t.get("name"), str) and t.get("template")
            }
            if named:
                return named
        if isinstance(tpl, str) and tpl:
            return tpl
    return None
