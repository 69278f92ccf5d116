"""Chat start-up: Settings into a loaded text or vision model, its started engine and its
chat service."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

from mlx_server.boot.disk_tier import disk_tier
from mlx_server.boot.memory import kv_budget_bytes, prompt_cache_bytes
from mlx_server.config import Settings
from mlx_server.engine.constraints import ConstraintCompiler, ConstraintError
from mlx_server.engine.engine import Engine, EngineConfig
from mlx_server.engine.kv_quant import QuantizedKVModel
from mlx_server.engine.protocol import GenerationObserver
from mlx_server.engine.speculative.drafters import check_same_tokenizer
from mlx_server.engine.speculative.runner import Speculation
from mlx_server.engine.tuning import (
    builds_kernels_on_first_use,
    default_batch_size,
    default_prefill_step,
)
from mlx_server.engine.vision_engine import VisionEngine
from mlx_server.logs import log
from mlx_server.models.base import ModelLoadError, trained_context
from mlx_server.models.loader import activation_bytes, kv_bytes_per_token, load_model
from mlx_server.models.media import MediaLimits
from mlx_server.models.vision import VisionPromptBuilder
from mlx_server.service import ChatService
from mlx_server.startup_report import weights_line


@dataclass
class ModelParts:
    """One loaded model as served: its chat service and its started engine."""

    service: Any
    engine: Any
    loaded: Any  # the LoadedModel
    vision: bool
    kv_budget_bytes: int


def load_chat_model(
    settings: Settings, sharded: Any = None, observer: GenerationObserver | None = None
) -> ModelParts:
    """Load ``settings.model`` and start its engine (kernels built before it returns).
    ``sharded``: rank 0 of several (``sharded.Rank``): the model is split across the ranks
    and the engine runs in lockstep with theirs; ``observer``: watches the engine's
    generations (the metrics)."""
    loaded = load_model(
        settings.model,
        model_id=settings.model_id,
        dtype=settings.dtype,
        chat_template=settings.chat_template,
        shard=sharded.shard if sharded is not None else None,
    )
    log(f"Model id: {loaded.model_id} ({loaded.path})")
    log(weights_line(loaded.model, loaded.config, settings.dtype))
    if settings.chat_template:
        log("Chat template: the one given with --chat-template")
    if settings.embedding:
        log(
            "--embedding: this model generates text, so it is served as a text-generation "
            "model (chat, completions, messages, responses)"
        )
    kv_budget = kv_budget_bytes(settings)
    vision = "vision" in loaded.capabilities
    engine_class: Any = Engine
    if vision:  # mlx-vlm's generation step: pixels in, one request at a time
        engine_class = VisionEngine
    model, kv_per_token = loaded.model, loaded.kv_bytes_per_token
    disk, disk_off = None, ""
    if not vision:
        model, kv_per_token = _quantized_kv(loaded, settings, model, kv_per_token)
        if sharded is None:
            disk, disk_off = disk_tier(loaded, settings)
        else:
            disk_off = "the disk tier is off across ranks"
    batch = _batch_size(settings, kv_budget, kv_per_token)
    engine = engine_class(
        model,
        loaded.tokenizer,
        EngineConfig(
            max_batch_size=batch,
            max_queue=settings.max_queue,
            prefill_step_size=settings.prefill_step_size or default_prefill_step(),
            prompt_cache_size=settings.prompt_cache_size,
            prompt_cache_bytes=prompt_cache_bytes(settings, kv_budget),
            kv_budget_bytes=kv_budget,
            kv_bytes_per_token=kv_per_token,
            prompt_cache_disk=disk,
            prompt_cache_disk_off=disk_off,
            warm_up=not vision and builds_kernels_on_first_use(),
            prefill_buckets=not vision and builds_kernels_on_first_use(),
            speculation=None if vision or sharded else _speculation(loaded, settings, model),
            lockstep=sharded.lead() if sharded is not None else None,
        ),
        observer=observer,
    )
    service = ChatService(
        loaded.model_id,
        loaded.tokenizer,
        engine,
        ctx_size=settings.ctx_size,
        tool_call_parser=settings.tool_call_parser,
        constraints=_constraint_compiler(loaded.tokenizer),
        vision=_vision_prompt_builder(loaded, settings) if vision else None,
        capabilities=loaded.capabilities,
        trained_ctx=trained_context(loaded.config),
    )
    log(
        f"KV budget: {kv_budget // (1 << 20)}MB, max batch size {batch}, prefix cache "
        f"{engine.config.prompt_cache_bytes // (1 << 20)}MB"
    )
    engine.start()
    engine.wait_ready()  # kernels for every batch shape are built before the readiness line
    return ModelParts(service, engine, loaded, vision, kv_budget)


def _batch_size(settings: Settings, kv_budget: int, kv_per_token: int) -> int:
    """``--max-batch-size``; 0 is the Swift server's "batching off": one sequence at a time."""
    if settings.max_batch_size == 0:
        log("Batching off (--max-batch-size 0): one sequence at a time")
        return 1
    if settings.max_batch_size is not None:
        return settings.max_batch_size
    return default_batch_size(kv_budget, kv_per_token, settings.ctx_size)


def _quantized_kv(loaded: Any, settings: Settings, model: Any, per_token: int) -> tuple[Any, int]:
    """The model wrapped to quantize its KV cache (``--kv-bits``), and the KV bytes per token."""
    if not settings.kv_bits:
        return model, per_token
    per_token = kv_bytes_per_token(
        loaded.config, activation_bytes(loaded.model), settings.kv_bits, settings.kv_group_size
    )
    log(
        f"KV cache: {settings.kv_bits}-bit, group size {settings.kv_group_size} "
        f"({per_token} bytes per token)"
    )
    return QuantizedKVModel(model, settings.kv_bits, settings.kv_group_size), per_token


def _vision_prompt_builder(loaded: Any, settings: Settings) -> Any:
    limits = MediaLimits(
        max_images=settings.max_images,
        max_image_bytes=int(settings.max_image_mb * (1 << 20)),
        max_image_pixels=settings.max_image_pixels,
        max_video_bytes=int(settings.max_video_mb * (1 << 20)),
        allow_remote=settings.allow_remote_images,
    )
    log(
        f"Vision: up to {limits.max_images} images per request, requests run one at a time, "
        f"remote image URLs {'allowed' if limits.allow_remote else 'refused'}"
    )
    return VisionPromptBuilder(loaded.processor, loaded.config, limits)


def _constraint_compiler(tokenizer: Any) -> Any:
    """The grammar compiler for structured output, or None when the tokenizer can't have one."""
    try:
        return ConstraintCompiler(tokenizer)
    except ConstraintError as e:
        log(f"Structured output is unavailable for this model: {e}")
        return None


def _speculation(loaded: Any, settings: Settings, model: Any) -> Any:
    """Speculative decoding's settings, with the draft model loaded and checked (its
    tokenizer must be the model's), or None when it is off. Predicted outputs need no
    flag: a request that brings one speculates whenever it runs alone."""
    if not can_trim_prompt_cache(make_prompt_cache(model)):
        if settings.prompt_lookup or settings.draft_model:
            raise ModelLoadError(
                "speculative decoding needs a KV cache that can be rolled back, and this "
                "model's (or the quantized KV cache's) cannot; drop --prompt-lookup and "
                "--draft-model, or --kv-bits"
            )
        return None
    draft = None
    if settings.draft_model:
        drafted = load_model(settings.draft_model, dtype=settings.dtype)
        if "vision" in drafted.capabilities:
            raise ModelLoadError("--draft-model: a vision model cannot draft")
        try:
            check_same_tokenizer(loaded.tokenizer, drafted.tokenizer)
        except ValueError as e:
            raise ModelLoadError(f"--draft-model {settings.draft_model}: {e}") from e
        draft = drafted.model
        log(f"Draft model: {drafted.model_id} ({drafted.path})")
    return Speculation(
        num_draft_tokens=settings.num_draft_tokens,
        prompt_lookup=settings.prompt_lookup,
        draft_model=draft,
    )
