"""Chat start-up: Settings into a loaded text or vision model, its started engine and its
chat service."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlx_server.boot.disk_tier import disk_tier
from mlx_server.boot.memory import prompt_cache_bytes
from mlx_server.config import Settings
from mlx_server.engine.cache.checkpoints import needs_checkpoints
from mlx_server.engine.cache.kv_quant import QuantizedKVModel
from mlx_server.engine.cache.kv_quant_layers import NoQuantizableLayer, plan_layers
from mlx_server.engine.core.engine import Engine, EngineConfig
from mlx_server.engine.core.protocol import GenerationObserver
from mlx_server.engine.core.slow_steps import SLOW_STEP_S
from mlx_server.engine.core.tuning import (
    COLD_FIRST_TOKEN_S,
    LONE_DECODE_KEYS,
    builds_kernels_on_first_use,
    default_batch_size,
    default_prefill_step,
)
from mlx_server.engine.grammar.constraints import ConstraintCompiler, ConstraintError
from mlx_server.engine.runners.assembly import text_runner
from mlx_server.engine.runners.vision import vision_runner
from mlx_server.engine.runners.vision_prefill import batch_refusal
from mlx_server.engine.speculative.assembly import speculative_runner
from mlx_server.engine.speculative.drafters import check_same_tokenizer
from mlx_server.engine.speculative.rollback import layer_kinds, rollback_problem
from mlx_server.engine.speculative.runner import Speculation
from mlx_server.logs import log
from mlx_server.models.base import ModelLoadError, trained_context
from mlx_server.models.loader import activation_bytes, kv_bytes_per_token, load_model
from mlx_server.models.media import MediaLimits
from mlx_server.models.memory_plan import kv_shape, plan_memory, read_device, weights_bytes
from mlx_server.models.vision import VisionPromptBuilder
from mlx_server.service import ChatService
from mlx_server.startup_report import START, weights_line


@dataclass
class ModelParts:
    """One loaded model as served: its chat service and its started engine."""

    service: Any
    engine: Any
    loaded: Any  # the LoadedModel
    vision: bool
    kv_budget_bytes: int


def load_chat_model(
    settings: Settings,
    sharded: Any = None,
    observer: GenerationObserver | None = None,
    *,
    ready_early: bool = False,
) -> ModelParts:
    """Load ``settings.model`` and start its engine (kernels built before it returns).
    ``sharded``: rank 0 of several (``sharded.Rank``): the model is split across the ranks
    and the engine runs in lockstep with theirs; ``observer``: watches the engine's
    generations (the metrics); ``ready_early``: where kernels are built on first use,
    return once the first token has run ``COLD_FIRST_TOKEN_S`` without finishing (an empty
    kernel cache: a readiness line need not wait for builds a first request waits for
    anyway; a failure after it refuses requests with the reason)."""
    loaded = load_model(
        settings.model,
        model_id=settings.model_id,
        dtype=settings.dtype,
        chat_template=settings.chat_template,
        shard=sharded.shard if sharded is not None else None,
    )
    START.mark("load")
    log(f"Model id: {loaded.model_id} ({loaded.path})")
    log(weights_line(loaded.model, loaded.config, settings.dtype))
    if settings.chat_template:
        log("Chat template: the one given with --chat-template")
    if settings.embedding:
        log(
            "--embedding: this model generates text, so it is served as a text-generation "
            "model (chat, completions, messages, responses)"
        )
    vision = "vision" in loaded.capabilities
    model, kv_per_token = loaded.model, loaded.kv_bytes_per_token
    disk, disk_off = None, ""
    if not vision:
        model, kv_per_token = _quantized_kv(loaded, settings, model, kv_per_token)
    plan = _memory_plan(settings, loaded, kv_per_token)
    kv_budget, kv = plan.budget, plan.kv
    if vision and batch_refusal(model):
        disk_off = "this vision model runs one request at a time, without the prefix cache"
    elif sharded is None:
        disk, disk_off = disk_tier(loaded, settings)
    else:
        disk_off = "the disk tier is off across ranks"
    batch = _batch_size(settings, kv_budget, kv.bytes_for(settings.ctx_size))
    config = EngineConfig(
        max_batch_size=batch,
        max_queue=settings.max_queue,
        prefill_step_size=settings.prefill_step_size or default_prefill_step(),
        prompt_cache_size=settings.prompt_cache_size,
        prompt_cache_bytes=prompt_cache_bytes(settings, kv_budget),
        kv_budget_bytes=kv_budget,
        kv_bytes_per_token=kv.per_token,
        kv_bytes_per_sequence=kv.per_sequence,
        prompt_cache_disk=disk,
        prompt_cache_disk_off=disk_off,
        warm_up=builds_kernels_on_first_use(),  # a vision model: its language model's shapes
        first_token=not vision and sharded is None,
        ready_after_s=_ready_after(ready_early),
        wired_bytes=plan.weights + plan.budget,
        prefill_buckets=builds_kernels_on_first_use(),
        lone_decode_keys=_lone_decode_keys(settings, vision, sharded, kv_budget, kv.per_token),
        slow_step_s=SLOW_STEP_S if builds_kernels_on_first_use() else float("inf"),
        lockstep=sharded.lead() if sharded is not None else None,
    )
    engine = _engine(loaded, settings, model, config, vision, observer)
    constraints = _constraint_compiler(loaded.tokenizer)
    if constraints is not None:  # ready before a first json_schema request, not in its time
        engine.when_idle("structured output's tokenizer", constraints.prepare)
    service = ChatService(
        loaded.model_id,
        loaded.tokenizer,
        engine,
        ctx_size=settings.ctx_size,
        tool_call_parser=settings.tool_call_parser,
        constraints=constraints,
        vision=_vision_prompt_builder(loaded, settings) if vision else None,
        capabilities=loaded.capabilities,
        trained_ctx=trained_context(loaded.config),
        history_ends=not vision and settings.prompt_cache_size > 0 and needs_checkpoints(model),
    )
    engine.when_idle("the chat template", service.prepare_template)
    log(
        f"KV budget: {kv_budget // (1 << 20)}MB, max batch size {batch}, prefix cache "
        f"{engine.config.prompt_cache_bytes // (1 << 20)}MB"
    )
    START.mark("service")
    engine.start()
    engine.wait_ready()  # a lone request's kernels are built before the readiness line
    # (on a cold kernel cache with ``ready_early``: a few seconds into the first token)
    START.mark("warm-up")
    if engine.start_error:  # no readiness line for a model that cannot run
        engine.shutdown()
        raise ModelLoadError(engine.start_error)
    return ModelParts(service, engine, loaded, vision, kv_budget)


def _ready_after(ready_early: bool) -> float:
    """``EngineConfig.ready_after_s``: ``COLD_FIRST_TOKEN_S`` where the caller prints a
    readiness line and kernels are built on first use (CUDA), else never."""
    return COLD_FIRST_TOKEN_S if ready_early and builds_kernels_on_first_use() else float("inf")


def _engine(
    loaded: Any,
    settings: Settings,
    model: Any,
    config: EngineConfig,
    vision: bool,
    observer: GenerationObserver | None,
) -> Engine:
    """The engine with the runner that fits: the vision runner (the vision tower at
    prefill, the language model in the batch), the speculative one, or the plain text one."""
    tokenizer = loaded.tokenizer
    if vision:
        setup = vision_runner(model, tokenizer, config)
        return Engine(setup.model, tokenizer, setup.config, runner=setup.runner, observer=observer)
    spec = _speculation(loaded, settings, model) if config.lockstep is None else None
    if spec is not None:
        runner = speculative_runner(model, tokenizer, config, spec)
    else:
        runner = text_runner(model, tokenizer, config)
    return Engine(model, tokenizer, config, runner=runner, observer=observer)


def _memory_plan(settings: Settings, loaded: Any, kv_per_token: int) -> Any:
    """How the device's memory is shared (models/memory_plan.py), logged in one line;
    raises ModelLoadError when the weights leave no room for a conversation."""
    given = settings.kv_budget_gb
    plan = plan_memory(
        read_device(),
        weights_bytes(loaded.model),
        kv_shape(loaded.config, kv_per_token),
        settings.ctx_size,
        budget_override=int(given * (1 << 30)) if given is not None else None,
    )
    if not plan.fits:
        raise ModelLoadError(plan.refusal())
    log(plan.line())
    return plan


def _lone_decode_keys(
    settings: Settings, vision: bool, sharded: Any, kv_budget: int, kv_per_token: int
) -> int:
    """The longest key buffer whose lone decode step the idle-time warm-up runs: where
    kernels are built per shape (CUDA), for a text model on one rank, within the context
    and the KV budget (``tuning.lone_decode_lengths``)."""
    if vision or sharded is not None or not builds_kernels_on_first_use():
        return 0
    return min(LONE_DECODE_KEYS, settings.ctx_size, kv_budget // max(1, kv_per_token))


def _batch_size(settings: Settings, kv_budget: int, kv_per_sequence: int) -> int:
    """``--max-batch-size``; 0 is the Swift server's "batching off": one sequence at a time."""
    if settings.max_batch_size == 0:
        log("Batching off (--max-batch-size 0): one sequence at a time")
        return 1
    if settings.max_batch_size is not None:
        return settings.max_batch_size
    return default_batch_size(kv_budget, kv_per_sequence)


def _quantized_kv(loaded: Any, settings: Settings, model: Any, per_token: int) -> tuple[Any, int]:
    """The model wrapped to quantize its KV cache (``--kv-bits``) on the layers that can
    take it, and the KV bytes per token; a model none of whose layers can is refused."""
    if not settings.kv_bits:
        return model, per_token
    bits, group = settings.kv_bits, settings.kv_group_size
    try:
        plan = plan_layers(model, bits, group)
    except NoQuantizableLayer as e:
        raise ModelLoadError(str(e)) from e
    share = len(plan.quantized) / (len(plan.quantized) + len(plan.plain))
    quantized = kv_bytes_per_token(loaded.config, activation_bytes(loaded.model), bits, group)
    per_token = int(quantized * share + per_token * (1 - share))
    log(
        f"KV cache: {bits}-bit, group size {group} ({per_token} bytes per token); "
        + plan.describe()
    )
    return QuantizedKVModel(model, bits, group, plan.quantized), per_token


def _vision_prompt_builder(loaded: Any, settings: Settings) -> Any:
    limits = MediaLimits(
        max_images=settings.max_images,
        max_image_bytes=int(settings.max_image_mb * (1 << 20)),
        max_image_pixels=settings.max_image_pixels,
        max_video_bytes=int(settings.max_video_mb * (1 << 20)),
        allow_remote=settings.allow_remote_images,
    )
    log(
        f"Vision: up to {limits.max_images} images per request, "
        f"remote image URLs {'allowed' if limits.allow_remote else 'refused'}"
    )
    return VisionPromptBuilder(loaded.processor, loaded.config, limits)


def _constraint_compiler(tokenizer: Any) -> Any:
    """The grammar compiler for structured output, or None when the tokenizer can't have one."""
    try:
        # wrapped in the engine's idle time (``prepare``), or by a constrained request before it
        return ConstraintCompiler(tokenizer, lazy=True)
    except ConstraintError as e:
        log(f"Structured output is unavailable for this model: {e}")
        return None


def _speculation(loaded: Any, settings: Settings, model: Any) -> Speculation | None:
    """Speculative decoding's settings, with the draft model loaded and checked (its
    tokenizer must be the model's), or None when it is off. Predicted outputs need no
    flag: a request that brings one speculates whenever it runs alone."""
    cache = make_prompt_cache(model)
    if (problem := rollback_problem(cache)) is not None:
        if settings.prompt_lookup or settings.draft_model:
            raise ModelLoadError(
                f"speculative decoding is not available for this model: {problem}; drop "
                "--prompt-lookup and --draft-model"
            )
        log(f"Predicted outputs are not used to speculate on this model: {problem}")
        return None
    if settings.prompt_lookup or settings.draft_model:
        log(_speculation_note(cache, layer_kinds(cache)))
    draft = None
    if settings.draft_model:
        drafted = load_model(settings.draft_model, dtype=settings.dtype)
        if "vision" in drafted.capabilities:
            raise ModelLoadError("--draft-model: a vision model cannot draft")
        if (problem := rollback_problem(make_prompt_cache(drafted.model))) is not None:
            raise ModelLoadError(f"--draft-model {settings.draft_model}: {problem}")
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


def _speculation_note(cache: list[Any], kinds: str) -> str:
    """What speculation does on this model's layers (the start-up log line)."""
    if all(type(c) is KVCache for c in cache):
        return f"Speculative decoding: on ({kinds})"
    return (
        f"Speculative decoding: on ({kinds}); after a rejected draft, layers that cannot "
        "be trimmed are restored and fed the accepted tokens again"
    )
