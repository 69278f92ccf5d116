"""Wires Settings into a loaded model, an engine, a chat service and the app."""

from __future__ import annotations

from typing import Any

from mlx_server.config import Settings
from mlx_server.logs import log


def set_cache_limit(settings: Settings) -> int:
    """MLX's buffer-cache limit (freed buffers kept for reuse). Returns bytes."""
    import mlx.core as mx

    from mlx_server.models.loader import device_memory_bytes

    if settings.cache_limit_gb is not None:
        limit = int(settings.cache_limit_gb * (1 << 30))
    else:
        limit = min(device_memory_bytes() // 4, 20 << 30)
    mx.set_cache_limit(limit)
    log(f"Memory cache limit: {limit // (1 << 20)}MB")
    return limit


def prompt_cache_bytes(settings: Settings, kv_budget: int) -> int:
    """The prefix cache's RAM tier: ``--prompt-cache-gb``, else the whole KV budget. The
    budget (engine/memory.py) counts the tier and evicts from it before a request waits, so
    cached prompts use memory only while running requests do not need it."""
    if settings.prompt_cache_gb is not None:
        return int(settings.prompt_cache_gb * (1 << 30))
    return kv_budget


def build(settings: Settings) -> tuple[Any, Any]:
    """Load the model and return (app, engine); the engine thread is started."""
    from mlx_server.app import create_app
    from mlx_server.engine.engine import Engine, EngineConfig
    from mlx_server.engine.tuning import (
        builds_kernels_on_first_use,
        default_batch_size,
        default_prefill_step,
    )
    from mlx_server.models.loader import device_memory_bytes, load_model
    from mlx_server.protocols.responses.store import ResponseStore
    from mlx_server.server.browser_guard import BrowserPolicy
    from mlx_server.server.middleware import MAX_BODY_BYTES
    from mlx_server.service import ChatService

    set_cache_limit(settings)
    loaded = load_model(settings.model, model_id=settings.model_id, dtype=settings.dtype)
    log(f"Model id: {loaded.model_id} ({loaded.path})")
    budget = settings.kv_budget_gb
    kv_budget = int(budget * (1 << 30)) if budget is not None else device_memory_bytes() // 4
    vision = "vision" in loaded.capabilities
    engine_class: Any = Engine
    if vision:  # mlx-vlm's generation step: pixels in, one request at a time
        from mlx_server.engine.vision_engine import VisionEngine

        engine_class = VisionEngine
    model, kv_per_token = loaded.model, loaded.kv_bytes_per_token
    disk = None
    if not vision:
        model, kv_per_token = _quantized_kv(loaded, settings, model, kv_per_token)
        disk = _disk_tier(loaded, settings)
    batch = settings.max_batch_size or default_batch_size(
        kv_budget, kv_per_token, settings.ctx_size
    )
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
            warm_up=not vision and builds_kernels_on_first_use(),
        ),
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
    )
    log(
        f"KV budget: {kv_budget // (1 << 20)}MB, max batch size {batch}, prefix cache "
        f"{engine.config.prompt_cache_bytes // (1 << 20)}MB"
    )
    engine.start()
    engine.wait_ready()  # kernels for every batch shape are built before the readiness line
    max_body = MAX_BODY_BYTES
    if vision:  # room for at least one base64 image of the largest size allowed
        max_body = max(max_body, int(settings.max_image_mb * (1 << 20) * 4 / 3) + (1 << 20))
    browser = BrowserPolicy.from_flags(
        settings.host, settings.allowed_hosts, settings.allowed_origins
    )
    store = ResponseStore(
        settings.responses_store_size, int(settings.responses_store_mb * (1 << 20))
    )
    app = create_app(
        service,
        api_key=settings.api_key,
        vision=vision,
        max_body=max_body,
        browser=browser,
        metrics_open=settings.metrics_open,
        responses_store=store,
        webui=not settings.no_webui,
    )
    return app, engine


def _quantized_kv(loaded: Any, settings: Settings, model: Any, per_token: int) -> tuple[Any, int]:
    """The model wrapped to quantize its KV cache (``--kv-bits``), and the KV bytes per token."""
    if not settings.kv_bits:
        return model, per_token
    from mlx_server.engine.kv_quant import QuantizedKVModel
    from mlx_server.models.loader import activation_bytes, kv_bytes_per_token

    per_token = kv_bytes_per_token(
        loaded.config, activation_bytes(loaded.model), settings.kv_bits, settings.kv_group_size
    )
    log(
        f"KV cache: {settings.kv_bits}-bit, group size {settings.kv_group_size} "
        f"({per_token} bytes per token)"
    )
    return QuantizedKVModel(model, settings.kv_bits, settings.kv_group_size), per_token


def _disk_tier(loaded: Any, settings: Settings) -> Any:
    """The prefix cache's disk tier (``--prompt-cache-dir``), or None when it is off."""
    if settings.prompt_cache_dir == "" or settings.prompt_cache_size <= 0:
        return None
    from pathlib import Path

    from mlx_server.engine.disk_cache import DiskPromptCache, default_root, model_cache_dir
    from mlx_server.models.loader import activation_bytes

    cfg = loaded.config.get("text_config", loaded.config)
    layout = {
        "activation_bytes": activation_bytes(loaded.model),
        "dtype": settings.dtype,
        "kv_bits": settings.kv_bits,
        "kv_group_size": settings.kv_group_size if settings.kv_bits else None,
        "layers": cfg.get("num_hidden_layers"),
        "kv_heads": cfg.get("num_key_value_heads", cfg.get("num_attention_heads")),
        "head_dim": cfg.get("head_dim"),
    }
    root = (
        Path(settings.prompt_cache_dir).expanduser()
        if settings.prompt_cache_dir
        else default_root()
    )
    directory = model_cache_dir(root, Path(loaded.path), layout)
    try:
        disk = DiskPromptCache(directory, int(settings.prompt_cache_disk_gb * (1 << 30)))
    except OSError as e:
        log(f"Prompt cache: disk tier off, cannot use {directory}: {e}")
        return None
    stats = disk.stats()
    log(
        f"Prompt cache disk tier: {directory} ({stats['prompt_cache_disk_entries']} entries, "
        f"{stats['prompt_cache_disk_bytes'] >> 20}MB, limit {settings.prompt_cache_disk_gb:g}GB)"
    )
    return disk


def _vision_prompt_builder(loaded: Any, settings: Settings) -> Any:
    from mlx_server.models.media import MediaLimits
    from mlx_server.models.vision import VisionPromptBuilder

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
    from mlx_server.engine.constraints import ConstraintCompiler, ConstraintError

    try:
        return ConstraintCompiler(tokenizer)
    except ConstraintError as e:
        log(f"Structured output is unavailable for this model: {e}")
        return None
