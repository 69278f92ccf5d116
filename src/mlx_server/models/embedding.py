"""Embedding and reranker models: recognised by their files, loaded with mlx-embeddings.

A sentence-transformers model says how it turns token states into one vector in its own
files: ``modules.json`` (which modules run: Transformer, Pooling, Normalize),
``1_Pooling/config.json`` (the pooling mode) and ``sentence_bert_config.json`` (the maximum
length); ``config_sentence_transformers.json`` names prompts (a query instruction) and a
cross-encoder's activation. A cross-encoder reranker is a ``*ForSequenceClassification``
checkpoint with one label, or a causal LM whose ``modules.json`` ends in a ``LogitScore``
module (the Qwen3-Reranker layout: the score is the logit of "yes" minus "no" at the last
token of a chat-templated prompt). The encoders themselves are mlx-embeddings' models
(``mlx_embeddings.models.<type>``), the causal rerankers mlx-lm's; mlx-embeddings' private
loader pieces we use are pinned and checked in tests/engine/test_mlx_embeddings_contract.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlx_server.models.base import ModelLoadError, settle_arrays

# Encoder types whose states are read bidirectionally (mean/CLS pooling by default); any
# other type mlx-embeddings serves is a decoder embedder (last-token pooling by default).
ENCODER_TYPES = frozenset({"bert", "xlm_roberta", "modernbert"})
POOLING_MODES = ("mean", "cls", "max", "lasttoken", "mean_sqrt_len_tokens")
# sentence-transformers' Pooling config keys, in its order of precedence.
_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
}


@dataclass(frozen=True)
class EncoderSpec:
    """How a model's token states become the answer: a vector or a relevance score."""

    kind: str  # "embedding" or "rerank"
    pooling: str  # one of POOLING_MODES (embeddings)
    normalize: bool  # L2-normalise the pooled vector (a Normalize module)
    max_length: int  # tokens per input, special tokens included
    dimensions: int  # width of the vector (embeddings)
    score_activation: str = "sigmoid"  # "sigmoid" or "identity" (rerank)
    # rerank: "classifier" (a sequence-classification head on a pair encoding) or
    # "logit_score" (a causal LM's token logits on a chat-templated prompt)
    head: str = "classifier"
    score_tokens: tuple[int, int | None] = (0, None)  # logit_score: the "yes" and "no" ids
    prompts: dict[str, str] = field(default_factory=dict)  # named prefixes (embedding)
    default_prompt: str | None = None  # the prompt name used when a request names none


@dataclass
class LoadedEncoder:
    model_id: str
    path: Path
    model: Any  # an mlx.nn.Module whose call returns ``last_hidden_state`` (or logits)
    tokenizer: Any  # tokenizers.Tokenizer
    config: dict[str, Any]
    spec: EncoderSpec
    pad_id: int = 0
    pair_prompt: Any = None  # a causal reranker's ChatPairPrompt (models/rerank_prompt.py)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e


def _architectures(config: dict[str, Any]) -> list[str]:
    arch = config.get("architectures") or []
    return [arch] if isinstance(arch, str) else [str(a) for a in arch]


def is_reranker(config: dict[str, Any]) -> bool:
    return any(a.endswith("ForSequenceClassification") for a in _architectures(config))


def is_encoder_model(model_dir: Path) -> bool:
    """Whether the directory holds an embedding or reranker model rather than a chat model:
    a sentence-transformers layout, a sequence classifier, or a bare encoder (``BertModel``)."""
    if (model_dir / "modules.json").is_file():
        return True
    config = _read_json(model_dir / "config.json") or {}
    if is_reranker(config):
        return True
    model_type = str(config.get("model_type", "")).replace("-", "_")
    causal = any(a.endswith("ForCausalLM") for a in _architectures(config))
    return model_type in ENCODER_TYPES and not causal


def ranks_documents(model_dir: Path) -> bool:
    """Whether the directory's encoder model is a reranker (scores a query against
    documents) rather than an embedder, as its load would read it; False where it cannot
    be read."""
    try:
        config = _read_json(model_dir / "config.json") or {}
        return isinstance(config, dict) and read_spec(model_dir, config).kind == "rerank"
    except (ModelLoadError, OSError, ValueError):
        return False


def read_spec(model_dir: Path, config: dict[str, Any]) -> EncoderSpec:
    """Pooling, normalisation and maximum length from the model's sentence-transformers
    files; where they are absent, the defaults sentence-transformers itself would take."""
    model_type = str(config.get("model_type", "")).replace("-", "_")
    positions = int(config.get("max_position_embeddings") or 512)
    if model_type in ("roberta", "xlm_roberta"):  # positions start after the padding index
        positions -= int(config.get("pad_token_id", 1) or 1) + 1
    st_config = _read_json(model_dir / "sentence_bert_config.json") or {}
    max_length = int(st_config.get("max_seq_length") or positions)
    st_model = _read_json(model_dir / "config_sentence_transformers.json") or {}
    modules = _read_json(model_dir / "modules.json") or []
    logit_score = _module(modules, "LogitScore")
    if logit_score is not None:
        tokens = _score_tokens(model_dir / logit_score.get("path", ""))
        activation = _activation(config, st_model)
        return EncoderSpec(
            "rerank", "lasttoken", False, max_length, 1, activation, "logit_score", tokens
        )
    if is_reranker(config):
        labels = len(config.get("id2label") or {}) or int(config.get("num_labels", 1))
        if labels != 1:
            raise ModelLoadError(f"a reranker has one output label; this one has {labels}")
        return EncoderSpec("rerank", "cls", False, max_length, 1, _activation(config, st_model))
    dims = int(config.get("hidden_size") or 0)
    normalize = _module(modules, "Normalize") is not None if modules else True
    pooling = "mean" if model_type in ENCODER_TYPES else "lasttoken"
    if (pooling_module := _module(modules, "Pooling")) is not None:
        pooling, dims = _pooling(model_dir / pooling_module.get("path", ""), dims)
    prompts = {str(k): str(v) for k, v in (st_model.get("prompts") or {}).items()}
    default = st_model.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ModelLoadError(f"default_prompt_name {default!r} names none of the prompts")
    return EncoderSpec(
        "embedding", pooling, normalize, max_length, dims, prompts=prompts, default_prompt=default
    )


def _module(modules: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    """The first module of ``modules.json`` whose class is named ``kind``."""
    return next((m for m in modules if str(m.get("type", "")).endswith(kind)), None)


def _activation(config: dict[str, Any], st_model: dict[str, Any]) -> str:
    """A cross-encoder's score activation as sentence-transformers picks it: the one saved
    in ``config_sentence_transformers.json`` (v5 on) or config.json (v4), else a sigmoid."""
    path = st_model.get("activation_fn") or config.get("sentence_transformers", {}).get(
        "activation_fn", ""
    )
    return "identity" if str(path).endswith("Identity") else "sigmoid"


def _score_tokens(folder: Path) -> tuple[int, int | None]:
    config = _read_json(folder / "config.json") or {}
    true_id = config.get("true_token_id")
    if not isinstance(true_id, int):
        raise ModelLoadError(f"{folder / 'config.json'} names no true_token_id")
    false_id = config.get("false_token_id")
    return true_id, int(false_id) if isinstance(false_id, int) else None


def _pooling(folder: Path, dims: int) -> tuple[str, int]:
    config = _read_json(folder / "config.json") or {}
    mode = config.get("pooling_mode")
    if mode is None:
        mode = next((m for k, m in _POOLING_KEYS.items() if config.get(k)), "mean")
    mode = {"mean_tokens": "mean", "cls_token": "cls", "max_tokens": "max"}.get(mode, mode)
    if mode not in POOLING_MODES:
        raise ModelLoadError(f"pooling mode {mode!r} in {folder} is not supported")
    return mode, int(config.get("word_embedding_dimension") or dims)


def load_encoder(model_dir: Path, *, model_id: str, dtype: str | None = None) -> LoadedEncoder:
    """Load an embedding or reranker model with mlx-embeddings. Raises ModelLoadError."""
    config = _read_json(model_dir / "config.json")
    if not isinstance(config, dict):
        raise ModelLoadError(f"no config.json in {model_dir}")
    spec = read_spec(model_dir, config)
    try:
        import mlx.core as mx

        model = _load_network(model_dir, config, spec)
        target = getattr(mx, dtype) if dtype is not None else _cpu_float32(model)
        if target is not None:
            model.set_dtype(target)
        settle_arrays(model)  # the encoder runs on the engine's thread
        tokenizer = _load_tokenizer(model_dir)
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"{type(e).__name__}: {e}") from e
    pad = config.get("pad_token_id")
    loaded = LoadedEncoder(model_id, model_dir, model, tokenizer, config, spec, int(pad or 0))
    if spec.head == "logit_score":
        from mlx_server.models.rerank_prompt import ChatPairPrompt

        loaded.pair_prompt = ChatPairPrompt.from_model_dir(model_dir, tokenizer)
    return loaded


def _cpu_float32(model: Any) -> Any:
    """float32 where MLX runs on the CPU and the stored weights are half precision: MLX's CPU
    matmuls in float16/bfloat16 do not go through BLAS (the demo embedding model ran 1.2 to
    1.3x slower in them than in float32 with OpenBLAS; docs/benchmarks.md). On a GPU (Metal,
    CUDA) the stored dtype is kept; quantized models are left alone."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    if mx.default_device().type != mx.DeviceType.cpu:
        return None
    params: Any = tree_flatten(model.parameters())
    dtypes = {v.dtype for _, v in params}
    if mx.uint32 in dtypes or not dtypes & {mx.float16, mx.bfloat16}:
        return None
    return mx.float32


def _load_network(model_dir: Path, config: dict[str, Any], spec: EncoderSpec) -> Any:
    if spec.head == "logit_score":
        from mlx_server.models.causal_reranker import load_causal_reranker

        return load_causal_reranker(model_dir, spec.score_tokens)
    if spec.kind == "rerank":
        from mlx_server.models.cross_encoder import load_cross_encoder

        return load_cross_encoder(model_dir, config)
    from mlx_embeddings.utils import load_model

    return load_model(model_dir, model_config=library_config(config), path_to_repo=str(model_dir))


def library_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config as mlx-embeddings' model arguments read it: transformers 5 nests
    ``rope_theta`` under ``rope_parameters``, where mlx-embeddings' Qwen3 does not look (it
    would silently take its own default base)."""
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in config:
        return {**config, "rope_theta": rope["rope_theta"]}
    return config


def _load_tokenizer(model_dir: Path) -> Any:
    """The fast tokenizer of ``tokenizer.json``, padding and truncation off (the engine pads,
    the service checks lengths)."""
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"no tokenizer.json in {model_dir}")
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer
