"""Torch kept out of a text model's process.

transformers imports torch wherever it is installed, and mlx-lm loads every tokenizer through
transformers; serving a text model never uses torch. On the CUDA image of the GPU runs torch
was most of a 12 s import phase (docs/benchmarks.md), on this CPU 1.4 s of a 5.3 s start. With
``sys.modules["torch"]`` set to None, ``importlib.util.find_spec("torch")`` answers None and
transformers runs as where torch is not installed (as the tests' server processes always
have). Vision-language models (image processors), embedding and reranker models, GGUF files,
hub ids and ``--models-dir`` (any model later) keep torch; so does ``MLX_SERVER_TORCH=1``."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path

ENV = "MLX_SERVER_TORCH"


def keep_torch_out(
    model: str | None, models_dir: str | None, environ: Mapping[str, str] | None = None
) -> str | None:
    """Hide torch from this process when ``--model`` is one local text model (and no
    ``--models-dir``); returns the line to log, or None when torch stays visible. Call before
    anything imports transformers (``cli.parse_launch`` calls it right after argparse)."""
    from mlx_server.config.options import split_repeated

    env = os.environ if environ is None else environ
    if env.get(ENV, "").strip().lower() in ("1", "true", "yes", "on"):
        return None
    if {"torch", "transformers"} & sys.modules.keys():  # too late: it has looked for torch
        return None
    paths = split_repeated(model or "")
    if models_dir or len(paths) != 1 or not _local_text_model(Path(paths[0]).expanduser()):
        return None
    sys.modules["torch"] = None  # type: ignore[assignment]
    return f"torch kept out of this text model's process ({ENV}=1 lets it in)"


def with_hint(message: str) -> str:
    """A load failure's message, with the way out where hidden torch may be its cause (a
    tokenizer's own code that imports torch)."""
    if sys.modules.get("torch", 0) is None and "torch" in message.lower():
        return f"{message} (torch was kept out of this process: {ENV}=1 lets it in)"
    return message


def _local_text_model(p: Path) -> bool:
    from mlx_server.models.embedding import is_encoder_model
    from mlx_server.models.vision import is_vision_config

    if not (p.is_dir() and (p / "config.json").is_file()):
        return False
    try:
        config = json.loads((p / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and not is_vision_config(config) and not is_encoder_model(p)
