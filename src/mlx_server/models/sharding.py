"""How a model is split across ranks: mlx-lm's tensor and pipeline parallelism.

- tensor parallel (``model.shard(group)``, mlx-lm's): every rank holds a slice of every
  layer's projections and the ranks sum their partial results in each layer. Needs the
  attention heads (and KV heads) to divide evenly by the number of ranks.
- pipeline parallel (``model.model.pipeline(group)``, mlx-lm's ``PipelineMixin``; for
  Llama models, which mlx-lm does not pipeline, ``llama_pipeline``): every rank holds a run
  of whole layers and hands the hidden state to the next rank. Needs at least one layer per
  rank; the ranks compute one after the other, so it serves models larger than one
  machine's memory rather than faster.

``auto`` takes pipeline parallelism where the model has it (the ranks' outputs are the
single-process model's to the bit), else tensor parallelism.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlx_server.models import llama_pipeline
from mlx_server.models.base import ModelLoadError

KINDS = ("auto", "pipeline", "tensor")


def _mlx_lm_pipeline(model: Any) -> bool:
    return hasattr(getattr(model, "model", None), "pipeline")


def has_pipeline(model: Any) -> bool:
    return _mlx_lm_pipeline(model) or llama_pipeline.supports(model)


def has_tensor(model: Any) -> bool:
    return hasattr(model, "shard")


def choose(kind: str, model: Any, config: dict[str, Any], size: int) -> str:
    """The kind to use ("pipeline" or "tensor") for ``model`` over ``size`` ranks; raises
    ModelLoadError saying why when the model cannot be split that way."""
    name = config.get("model_type", type(model).__module__.rsplit(".", 1)[-1])
    if kind == "auto":
        if has_pipeline(model):
            kind = "pipeline"
        elif has_tensor(model):
            kind = "tensor"
        else:
            raise ModelLoadError(
                f"this model ({name}) cannot be split across ranks: mlx-lm has neither "
                "pipeline nor tensor parallelism for it"
            )
    problem = (
        pipeline_problem(model, size) if kind == "pipeline" else tensor_problem(model, config, size)
    )
    if problem:
        raise ModelLoadError(f"--shard {kind}: {problem} (model type {name})")
    return kind


def pipeline_problem(model: Any, size: int) -> str | None:
    if not has_pipeline(model):
        return "mlx-lm has no pipeline parallelism for this model; try --shard tensor"
    layers = len(model.layers)
    if layers < size:
        return f"{size} ranks need at least {size} layers, the model has {layers}"
    return None


def tensor_problem(model: Any, config: dict[str, Any], size: int) -> str | None:
    if not has_tensor(model):
        return "mlx-lm has no tensor parallelism for this model; try --shard pipeline"
    cfg = config.get("text_config", config)
    heads = cfg.get("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads", heads)
    for what, n in (("attention heads", heads), ("key-value heads", kv_heads)):
        if isinstance(n, int) and n % size:
            return f"the model's {n} {what} do not divide evenly by {size} ranks"
    return None


def sharder(kind: str, group: Any) -> Callable[[Any, dict[str, Any]], str]:
    """A loader hook: split a lazily loaded model for this rank of ``group`` (before its
    weights are read) and return the kind used."""

    def shard(model: Any, config: dict[str, Any]) -> str:
        chosen = choose(kind, model, config, group.size())
        if chosen == "tensor":
            model.shard(group)
        elif _mlx_lm_pipeline(model):
            model.model.pipeline(group)
        else:
            llama_pipeline.pipeline(model, group)
        return chosen

    return shard
