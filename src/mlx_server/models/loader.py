"""Find, fetch and load a model: path rules, Hugging Face ids, GGUF files, chat templates."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlx_server.logs import log
from mlx_server.models.base import (  # re-exported: the loader's public names
    LoadedModel,
    ModelLoadError,
    activation_bytes,
    kv_bytes_per_token,
    read_chat_template,
    settle_arrays,
)
from mlx_server.models.cuda_paths import install_cuda_paths
from mlx_server.models.template_override import install_chat_template

__all__ = [
    "LoadedModel",
    "ModelLoadError",
    "activation_bytes",
    "device_memory_bytes",
    "kv_bytes_per_token",
    "load_model",
    "read_chat_template",
    "resolve_model_dir",
]


_HF_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


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
            from mlx_server.models.gguf.importer import GGUFImportError, import_cached

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


def load_model(
    model: str,
    *,
    model_id: str = "",
    dtype: str | None = None,
    chat_template: str = "",
    shard: Callable[[Any, dict[str, Any]], str] | None = None,
) -> LoadedModel:
    """Resolve, load and describe a model: mlx-lm for text, mlx-vlm for vision-language
    models (a config with a vision tower). ``chat_template``: ``--chat-template``, in place of
    the model's. ``shard``: split the model for this rank before its weights are read
    (``sharding.sharder``; text models only). Raises ModelLoadError."""
    log(f"Loading model from: {model}")
    model_dir = resolve_model_dir(model)
    from mlx_server.models.vision import is_vision_model, load_vision_model

    if is_vision_model(model_dir):
        if shard is not None:
            raise ModelLoadError("vision models cannot be served across ranks")
        return load_vision_model(
            model_dir,
            model_id=model_id or default_model_id(model),
            dtype=dtype,
            chat_template=chat_template,
        )
    try:
        import mlx.core as mx
        from mlx_lm.utils import dequantize_model
        from mlx_lm.utils import load as mlx_load

        net, tokenizer, config = mlx_load(  # type: ignore[misc]
            str(model_dir), return_config=True, lazy=shard is not None
        )
        if shard is not None:
            log(f"Sharding: {shard(net, config)} parallel")
        if dtype is not None:
            if config.get("quantization"):
                net = dequantize_model(net)
            net.set_dtype(getattr(mx, dtype))
        settle_arrays(net)
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"{type(e).__name__}: {e}") from e
    for line in install_cuda_paths(net):
        log(line)
    install_chat_template(tokenizer, read_chat_template(model_dir), chat_template)
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
    """The memory this process should plan with: Metal's recommended working set, a CUDA
    GPU's memory, else 3/4 of the RAM (``memory_plan.read_device``)."""
    from mlx_server.models.memory_plan import read_device

    return read_device().usable
