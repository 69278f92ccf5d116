"""Find, fetch and load a model: path rules, Hugging Face ids, GGUF files, chat templates."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_server.logs import log


class ModelLoadError(Exception):
    """The model could not be found or loaded; the message says why."""


_HF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


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


def default_model_id(model: str) -> str:
    """The model directory's name: the directory itself, or the parent of a file inside it.

    Never cut at a dot: ``Qwen2.5-7B`` stays ``Qwen2.5-7B``. A ``.gguf`` file is named after
    the file without its extension; a repo id after its last component.
    """
    p = Path(model).expanduser()
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            return p.stem
        return p.resolve().parent.name
    if p.is_dir():
        return p.resolve().name
    return model.rstrip("/").split("/")[-1]


def resolve_model_dir(model: str) -> Path:
    """Apply the path rules; download a Hugging Face repo id; import a GGUF file."""
    p = Path(model).expanduser()
    if p.is_dir():
        if (p / "config.json").is_file():
            log(f"Using local model directory: {p}")
            return p
        if (p.parent / "config.json").is_file():
            log(f"Using parent directory: {p.parent}")
            return p.parent
        raise ModelLoadError(f"no config.json in {p} or its parent directory")
    if p.is_file():
        if p.suffix.lower() == ".gguf":
            from mlx_server.models.gguf_import import GGUFImportError, import_cached

            try:
                return import_cached(p)
            except GGUFImportError as e:
                raise ModelLoadError(str(e)) from e
        if not (p.parent / "config.json").is_file():
            raise ModelLoadError(f"no config.json next to {p}")
        log(f"Using parent directory: {p.parent}")
        return p.parent
    if _HF_ID.match(model) and not model.startswith((".", "/")):
        return _download(model)
    raise ModelLoadError(f"model path does not exist: {model}")


def _download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - huggingface_hub comes with mlx-lm
        raise ModelLoadError("huggingface_hub is required to download models") from e
    log(f"Downloading {repo_id} from the Hugging Face Hub")
    try:
        path = snapshot_download(
            repo_id,
            allow_patterns=[
                "*.json",
                "*.safetensors",
                "*.jinja",
                "tokenizer.model",
                "*.txt",
                "*.tiktoken",
                "*.py",
            ],
        )
    except Exception as e:
        raise ModelLoadError(
            f"could not download '{repo_id}' from the Hugging Face Hub "
            f"({type(e).__name__}: {e}). If you are offline, pass a local model directory."
        ) from e
    return Path(path)


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


def load_model(model: str, *, model_id: str = "", dtype: str | None = None) -> LoadedModel:
    """Resolve, load and describe a model: mlx-lm for text, mlx-vlm for vision-language
    models (a config with a vision tower). Raises ModelLoadError."""
    log(f"Loading model from: {model}")
    model_dir = resolve_model_dir(model)
    from mlx_server.models.vision import is_vision_model, load_vision_model

    if is_vision_model(model_dir):
        return load_vision_model(
            model_dir, model_id=model_id or default_model_id(model), dtype=dtype
        )
    try:
        import mlx.core as mx
        from mlx_lm.utils import dequantize_model
        from mlx_lm.utils import load as mlx_load

        net, tokenizer, config = mlx_load(str(model_dir), return_config=True)  # type: ignore[misc]
        if dtype is not None:
            if config.get("quantization"):
                net = dequantize_model(net)
            net.set_dtype(getattr(mx, dtype))
            mx.eval(net.parameters())
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"{type(e).__name__}: {e}") from e
    template = read_chat_template(model_dir)
    if template is not None:
        tokenizer._tokenizer.chat_template = template
    if getattr(tokenizer._tokenizer, "chat_template", None) is None:
        raise ModelLoadError(f"the model in {model_dir} has no chat template")
    return LoadedModel(
        model_id=model_id or default_model_id(model),
        path=model_dir,
        model=net,
        tokenizer=tokenizer,
        config=config,
    )


def device_memory_bytes() -> int:
    """The device's recommended working set (Metal/CUDA), else physical RAM; 8 GiB if unknown."""
    try:
        import mlx.core as mx

        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        size = int(info.get("max_recommended_working_set_size") or info.get("memory_size") or 0)
        if size > 0:
            return size
    except Exception:
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8 << 30
