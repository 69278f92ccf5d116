"""``Settings``: every server option, declared once (default, help, bounds)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from mlx_server.config.options import option, split_repeated


@dataclass(frozen=True)
class Settings:
    model: str = option(
        "",
        "Model: a directory, a file inside one, a .gguf file or a Hugging Face repo id (give it "
        "several times to serve several models)",
        "-m",
        "--model",
        required=True,
        repeat=True,
    )
    port: int = option(8080, "Port to listen on", "--port", min=0, max=65535)
    ctx_size: int = option(
        4096,
        "Context size: prompt plus generated tokens per request (enforced)",
        "--ctx-size",
        min=1,
    )
    api_key: str = option(
        "",
        "API key required on every /v1 route (empty: no auth; also read from MLX_API_KEY, "
        "as Jan passes it, when neither the flag nor MLX_SERVER_API_KEY is given)",
        "--api-key",
    )
    model_id: str = option(
        "", "Model id reported by /v1/models (default: the model directory's name)", "--model-id"
    )
    host: str = option("127.0.0.1", "Address to bind", "--host")
    cache_limit_gb: float | None = option(
        None,
        "MLX buffer-cache limit in GB (default: a quarter of the device memory, at most 20)",
        "--cache-limit-gb",
        min=0,
    )
    max_batch_size: int | None = option(
        None,
        "Sequences decoded together in one batch (default: 8 on a CPU; on a GPU as many "
        "full-context sequences as the KV budget holds, 8 to 32; 0: batching off, one "
        "sequence at a time, as in the Swift server)",
        "--max-batch-size",
        min=0,
    )
    max_queue: int = option(
        64,
        "Requests allowed to wait for a batch slot before new ones get 503 (a /v1/completions "
        "batch asking for more generations at once gets 400)",
        "--max-queue",
        min=0,
    )
    max_n: int = option(
        16,
        "Most choices (n) one chat or text completions request may ask for",
        "--max-n",
        min=1,
    )
    prefill_step_size: int | None = option(
        None,
        "Prompt tokens processed per step (long prompts are prefilled in chunks; default: "
        "512 on a CPU, 2048 on a GPU)",
        "--prefill-step-size",
        min=1,
    )
    prompt_cache_size: int = option(
        16,
        "Prefix-cache entries kept (0 disables the prefix cache)",
        "--prompt-cache-size",
        min=0,
    )
    prompt_cache_gb: float | None = option(
        None,
        "Prefix-cache RAM tier in GB (default: the KV budget; running requests take memory "
        "back from it first, so a long agent conversation stays cached between turns)",
        "--prompt-cache-gb",
        min=0,
    )
    prompt_cache_dir: str | None = option(
        None,
        "Directory of the prefix cache's disk tier (default: per model under the user cache "
        "directory: ~/Library/Caches/mlx-server/prompt-cache on macOS, "
        "~/.cache/mlx-server/prompt-cache elsewhere; '' turns the disk tier off)",
        "--prompt-cache-dir",
    )
    prompt_cache_disk_gb: float = option(
        10.0,
        "Disk-tier size limit in GB (least recently used entries go first)",
        "--prompt-cache-disk-gb",
        min=0,
    )
    kv_bits: int | None = option(
        None,
        "Quantize the KV cache to 8 or 4 bits (default: the model's activation dtype)",
        "--kv-bits",
        choices=(4, 8),
    )
    kv_group_size: int = option(
        64, "Group size of the quantized KV cache", "--kv-group-size", choices=(32, 64, 128)
    )
    kv_budget_gb: float | None = option(
        None,
        "Memory for KV, the prefix cache's RAM tier and MLX's buffers in GB (default: what the "
        "device's usable memory leaves after the weights and a margin; logged at start)",
        "--kv-budget-gb",
        above=0,
    )
    chat_template: str = option(
        "",
        "Chat template replacing the model's: Jinja template text (what Jan's chat-template "
        "setting holds), a path to a .jinja file, or the name of a template the model ships "
        "(e.g. tool_use)",
        "--chat-template",
    )
    embedding: bool = option(
        False, "Serve the model as an embedding model (Jan passes it for one)", "--embedding"
    )
    prompt_lookup: bool = option(
        False,
        "Speculative decoding by prompt lookup: draft the tokens that followed the last few "
        "tokens where they occur earlier in the prompt or the answer, and verify them in one "
        "forward pass (output unchanged; fast when the answer quotes its context)",
        "--prompt-lookup",
    )
    num_draft_tokens: int = option(
        15,
        "Most tokens drafted per step when speculating (the count adapts per sequence to "
        "the measured acceptance, down to none)",
        "--num-draft-tokens",
        min=1,
        max=64,
    )
    draft_model: str | None = option(
        None,
        "A smaller model with the same tokenizer that drafts for speculative decoding "
        "(a directory or Hugging Face repo id)",
        "--draft-model",
    )
    draft_kind: str | None = option(
        None,
        "Kind of drafter: 'model' (a draft model), 'ngram' (prompt lookup); 'dflash', "
        "'eagle3' and 'mtp' are not built yet (default: from the other flags)",
        "--draft-kind",
    )
    draft_block_size: int | None = option(
        None,
        "Block size of block drafters (dflash); no drafter built yet uses it",
        "--draft-block-size",
        min=1,
    )
    tool_call_parser: str | None = option(
        None, "Tool-call format (default: detected from the chat template)", "--tool-call-parser"
    )
    dtype: str | None = option(
        None,
        "Convert weights on load: float32, bfloat16 or float16 (float32 is fastest on Linux CPU)",
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
    )
    allow_remote_images: bool = option(
        False,
        "Fetch http(s) image/video URLs (off: any client or web page reaching the server could "
        "make it request URLs on your network)",
        "--allow-remote-images",
    )
    max_images: int = option(16, "Images and videos allowed in one request", "--max-images", min=0)
    max_image_mb: float = option(
        20.0, "Largest image accepted, in MB (encoded)", "--max-image-mb", above=0
    )
    max_image_pixels: int = option(
        50_000_000,
        "Largest image accepted, in pixels (width x height)",
        "--max-image-pixels",
        min=1,
    )
    max_video_mb: float = option(100.0, "Largest video accepted, in MB", "--max-video-mb", above=0)
    allowed_hosts: str = option(
        "",
        "Extra Host names the server answers, comma-separated (default: loopback names and the "
        "bound address; '*': any). Other Hosts get 403, which stops DNS rebinding",
        "--allowed-hosts",
    )
    allowed_origins: str = option(
        "",
        "Extra browser origins allowed (CORS), comma-separated, e.g. http://example.test:3000 "
        "(default: Tauri's and http(s)://localhost pages; '*': any). Other origins get 403",
        "--allowed-origins",
    )
    metrics_open: bool = option(
        False, "Serve GET /metrics without the API key (for a local scraper)", "--metrics-open"
    )
    no_webui: bool = option(False, "Do not serve the chat page at /", "--no-webui")
    log_level: str = option("warning", "Log level for the HTTP layer (uvicorn)", "--log-level")
    models_dir: str = option(
        "",
        "Offer every model found in this directory (MLX model directories, .gguf files, a "
        "Hugging Face hub cache), each loaded on its first request",
        "--models-dir",
    )
    models_memory_gb: float | None = option(
        None,
        "Several models: memory for loaded models (weights, KV budget, prefix cache) in GB; "
        "least recently used idle models are unloaded to make room (default: device memory)",
        "--models-memory-gb",
        above=0,
    )
    models_max: int = option(
        0, "Several models: most models loaded at once (0: no limit)", "--models-max", min=0
    )
    idle_unload_s: float = option(
        0.0,
        "Several models: unload a model idle this many seconds (0: never); a request's "
        "keep_alive overrides it for its model",
        "--idle-unload-s",
        min=0,
    )
    pin: str = option(
        "",
        "Several models: a model id kept loaded (loaded at start, never unloaded); repeatable",
        "--pin",
        repeat=True,
    )
    shard: str = option(
        "auto",
        "Started under mlx.launch, how the model is split across the ranks: 'pipeline' "
        "(each rank a run of layers), 'tensor' (each rank a slice of every layer), 'auto' "
        "(pipeline where mlx-lm has it for the model, else tensor)",
        "--shard",
        choices=("auto", "pipeline", "tensor"),
    )
    ranks: int = option(
        1,
        "Serve the model sharded across this many processes on this machine: starts them "
        "with mlx.launch (ring backend over 127.0.0.1); 1: one process",
        "--ranks",
        min=1,
    )
    rank_timeout_s: float = option(
        60.0,
        "Sharded: seconds a step, or the wait for rank 0's next message, may take before the "
        "server decides a rank stopped answering and exits with an error",
        "--rank-timeout-s",
        above=0,
    )
    header_timeout_s: float = option(
        30.0,
        "Seconds a client may take to send a complete request head (as nginx's "
        "client_header_timeout); a connection that sends none in time is closed",
        "--header-timeout-s",
        above=0,
    )
    responses_store_size: int = option(
        500,
        "Responses API: stored responses kept in memory (least recently used out first; 0 keeps none)",
        "--responses-store-size",
        min=0,
    )
    responses_store_mb: float = option(
        256.0,
        "Responses API: memory limit of the stored responses, in MB",
        "--responses-store-mb",
        min=0,
    )

    @property
    def model_paths(self) -> list[str]:
        """Every ``--model`` given, in order."""
        return split_repeated(self.model)

    @property
    def pinned(self) -> list[str]:
        return split_repeated(self.pin)

    @property
    def several_models(self) -> bool:
        """Several models behind a registry; one ``--model`` alone is served as before."""
        return len(self.model_paths) > 1 or bool(self.models_dir)


def settings_fields() -> list[Any]:
    return list(fields(Settings))
