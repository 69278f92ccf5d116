"""Settings: every server option, declared once (default, help, bounds); the CLI is built from
this, and each option can also come from the environment as ``MLX_SERVER_<NAME>`` (for
example ``MLX_SERVER_PORT=9000``); a flag on the command line wins."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


def _opt(default: Any, help: str, *flags: str, **extra: Any) -> Any:
    """One option. ``extra``: ``required``, ``choices``, and bounds ``min`` / ``max``
    (inclusive) or ``above`` (exclusive), checked at start."""
    return field(default=default, metadata={"help": help, "flags": flags, **extra})


def user_cache_root() -> Path:
    """Where the server keeps what it makes (GGUF imports, the prefix cache's disk tier):
    ``$MLX_SERVER_CACHE``, else ``$XDG_CACHE_HOME/mlx-server``, else
    ``~/Library/Caches/mlx-server`` on macOS and ``~/.cache/mlx-server`` elsewhere."""
    if explicit := os.environ.get("MLX_SERVER_CACHE"):
        return Path(explicit).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg) / "mlx-server"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "mlx-server"
    return Path.home() / ".cache" / "mlx-server"


def env_name(name: str) -> str:
    return f"MLX_SERVER_{name.upper()}"


def check_bounds(name: str, value: Any, meta: Any) -> str | None:
    """Why ``value`` is out of the option's bounds, or None."""
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if "min" in meta and value < meta["min"]:
        return f"must be at least {meta['min']} (got {value})"
    if "max" in meta and value > meta["max"]:
        return f"must be at most {meta['max']} (got {value})"
    if "above" in meta and value <= meta["above"]:
        return f"must be greater than {meta['above']} (got {value})"
    return None


@dataclass(frozen=True)
class Settings:
    model: str = _opt(
        "",
        "Model: a directory, a file inside one, a .gguf file or a Hugging Face repo id (give it "
        "several times to serve several models)",
        "-m",
        "--model",
        required=True,
        repeat=True,
    )
    port: int = _opt(8080, "Port to listen on", "--port", min=0, max=65535)
    ctx_size: int = _opt(
        4096,
        "Context size: prompt plus generated tokens per request (enforced)",
        "--ctx-size",
        min=1,
    )
    api_key: str = _opt(
        "",
        "API key required on every /v1 route (empty: no auth; also read from MLX_API_KEY, "
        "as Jan passes it, when neither the flag nor MLX_SERVER_API_KEY is given)",
        "--api-key",
    )
    model_id: str = _opt(
        "", "Model id reported by /v1/models (default: the model directory's name)", "--model-id"
    )
    host: str = _opt("127.0.0.1", "Address to bind", "--host")
    cache_limit_gb: float | None = _opt(
        None,
        "MLX buffer-cache limit in GB (default: a quarter of the device memory, at most 20)",
        "--cache-limit-gb",
        min=0,
    )
    max_batch_size: int | None = _opt(
        None,
        "Sequences decoded together in one batch (default: 8 on a CPU; on a GPU as many "
        "full-context sequences as the KV budget holds, 8 to 32; 0: batching off, one "
        "sequence at a time, as in the Swift server)",
        "--max-batch-size",
        min=0,
    )
    max_queue: int = _opt(
        64,
        "Requests allowed to wait for a batch slot before new ones get 503",
        "--max-queue",
        min=0,
    )
    max_n: int = _opt(
        16,
        "Most choices (n) one chat or text completions request may ask for",
        "--max-n",
        min=1,
    )
    prefill_step_size: int | None = _opt(
        None,
        "Prompt tokens processed per step (long prompts are prefilled in chunks; default: "
        "512 on a CPU, 2048 on a GPU)",
        "--prefill-step-size",
        min=1,
    )
    prompt_cache_size: int = _opt(
        16,
        "Prefix-cache entries kept (0 disables the prefix cache)",
        "--prompt-cache-size",
        min=0,
    )
    prompt_cache_gb: float | None = _opt(
        None,
        "Prefix-cache RAM tier in GB (default: the KV budget; running requests take memory "
        "back from it first, so a long agent conversation stays cached between turns)",
        "--prompt-cache-gb",
        min=0,
    )
    prompt_cache_dir: str | None = _opt(
        None,
        "Directory of the prefix cache's disk tier (default: per model under the user cache "
        "directory: ~/Library/Caches/mlx-server/prompt-cache on macOS, "
        "~/.cache/mlx-server/prompt-cache elsewhere; '' turns the disk tier off)",
        "--prompt-cache-dir",
    )
    prompt_cache_disk_gb: float = _opt(
        10.0,
        "Disk-tier size limit in GB (least recently used entries go first)",
        "--prompt-cache-disk-gb",
        min=0,
    )
    kv_bits: int | None = _opt(
        None,
        "Quantize the KV cache to 8 or 4 bits (default: the model's activation dtype)",
        "--kv-bits",
        choices=(4, 8),
    )
    kv_group_size: int = _opt(
        64, "Group size of the quantized KV cache", "--kv-group-size", choices=(32, 64, 128)
    )
    kv_budget_gb: float | None = _opt(
        None,
        "Memory for KV, the prefix cache's RAM tier and MLX's buffers in GB (default: what the "
        "device's usable memory leaves after the weights and a margin; logged at start)",
        "--kv-budget-gb",
        above=0,
    )
    chat_template: str = _opt(
        "",
        "Chat template replacing the model's: Jinja template text (what Jan's chat-template "
        "setting holds), a path to a .jinja file, or the name of a template the model ships "
        "(e.g. tool_use)",
        "--chat-template",
    )
    embedding: bool = _opt(
        False, "Serve the model as an embedding model (Jan passes it for one)", "--embedding"
    )
    prompt_lookup: bool = _opt(
        False,
        "Speculative decoding by prompt lookup: draft the tokens that followed the last few "
        "tokens where they occur earlier in the prompt or the answer, and verify them in one "
        "forward pass (output unchanged; fast when the answer quotes its context)",
        "--prompt-lookup",
    )
    num_draft_tokens: int = _opt(
        8,
        "Most tokens drafted per step when speculating (the count adapts per sequence to "
        "the measured acceptance, down to none)",
        "--num-draft-tokens",
        min=1,
        max=64,
    )
    draft_model: str | None = _opt(
        None,
        "A smaller model with the same tokenizer that drafts for speculative decoding "
        "(a directory or Hugging Face repo id)",
        "--draft-model",
    )
    draft_kind: str | None = _opt(
        None,
        "Kind of drafter: 'model' (a draft model), 'ngram' (prompt lookup); 'dflash', "
        "'eagle3' and 'mtp' are not built yet (default: from the other flags)",
        "--draft-kind",
    )
    draft_block_size: int | None = _opt(
        None,
        "Block size of block drafters (dflash); no drafter built yet uses it",
        "--draft-block-size",
        min=1,
    )
    tool_call_parser: str | None = _opt(
        None, "Tool-call format (default: detected from the chat template)", "--tool-call-parser"
    )
    dtype: str | None = _opt(
        None,
        "Convert weights on load: float32, bfloat16 or float16 (float32 is fastest on Linux CPU)",
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
    )
    allow_remote_images: bool = _opt(
        False,
        "Fetch http(s) image/video URLs (off: any client or web page reaching the server could "
        "make it request URLs on your network)",
        "--allow-remote-images",
    )
    max_images: int = _opt(16, "Images and videos allowed in one request", "--max-images", min=0)
    max_image_mb: float = _opt(
        20.0, "Largest image accepted, in MB (encoded)", "--max-image-mb", above=0
    )
    max_image_pixels: int = _opt(
        50_000_000,
        "Largest image accepted, in pixels (width x height)",
        "--max-image-pixels",
        min=1,
    )
    max_video_mb: float = _opt(100.0, "Largest video accepted, in MB", "--max-video-mb", above=0)
    allowed_hosts: str = _opt(
        "",
        "Extra Host names the server answers, comma-separated (default: loopback names and the "
        "bound address; '*': any). Other Hosts get 403, which stops DNS rebinding",
        "--allowed-hosts",
    )
    allowed_origins: str = _opt(
        "",
        "Extra browser origins allowed (CORS), comma-separated, e.g. http://example.test:3000 "
        "(default: Tauri's and http(s)://localhost pages; '*': any). Other origins get 403",
        "--allowed-origins",
    )
    metrics_open: bool = _opt(
        False, "Serve GET /metrics without the API key (for a local scraper)", "--metrics-open"
    )
    no_webui: bool = _opt(False, "Do not serve the chat page at /", "--no-webui")
    log_level: str = _opt("warning", "Log level for the HTTP layer (uvicorn)", "--log-level")
    models_dir: str = _opt(
        "",
        "Offer every model found in this directory (MLX model directories, .gguf files, a "
        "Hugging Face hub cache), each loaded on its first request",
        "--models-dir",
    )
    models_memory_gb: float | None = _opt(
        None,
        "Several models: memory for loaded models (weights, KV budget, prefix cache) in GB; "
        "least recently used idle models are unloaded to make room (default: device memory)",
        "--models-memory-gb",
        above=0,
    )
    models_max: int = _opt(
        0, "Several models: most models loaded at once (0: no limit)", "--models-max", min=0
    )
    idle_unload_s: float = _opt(
        0.0,
        "Several models: unload a model idle this many seconds (0: never); a request's "
        "keep_alive overrides it for its model",
        "--idle-unload-s",
        min=0,
    )
    pin: str = _opt(
        "",
        "Several models: a model id kept loaded (loaded at start, never unloaded); repeatable",
        "--pin",
        repeat=True,
    )
    shard: str = _opt(
        "auto",
        "Started under mlx.launch, how the model is split across the ranks: 'pipeline' "
        "(each rank a run of layers), 'tensor' (each rank a slice of every layer), 'auto' "
        "(pipeline where mlx-lm has it for the model, else tensor)",
        "--shard",
        choices=("auto", "pipeline", "tensor"),
    )
    ranks: int = _opt(
        1,
        "Serve the model sharded across this many processes on this machine: starts them "
        "with mlx.launch (ring backend over 127.0.0.1); 1: one process",
        "--ranks",
        min=1,
    )
    rank_timeout_s: float = _opt(
        60.0,
        "Sharded: seconds a step, or the wait for rank 0's next message, may take before the "
        "server decides a rank stopped answering and exits with an error",
        "--rank-timeout-s",
        above=0,
    )
    responses_store_size: int = _opt(
        500,
        "Responses API: stored responses kept in memory (least recently used out first; 0 keeps none)",
        "--responses-store-size",
        min=0,
    )
    responses_store_mb: float = _opt(
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


def split_repeated(value: str) -> list[str]:
    """The values of a repeatable option: given several times, they arrive joined by newlines
    (an environment variable may hold several, one a line)."""
    return [v for v in value.split("\n") if v.strip()]


# The flag table of docs/configuration.md is written from the declarations above, between
# these markers (``python -m mlx_server.config --write docs/configuration.md``); a test fails
# when the committed table differs from what this writes.
TABLE_START = "<!-- flags:start (python -m mlx_server.config --write docs/configuration.md) -->"
TABLE_END = "<!-- flags:end -->"


def _shown_default(f: Any) -> str:
    value = f.default
    if f.metadata.get("required"):
        return "required"
    if value is None or value == "":
        return "—"
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def flags_markdown() -> str:
    """Every option as a Markdown table: flags, environment variable, default, meaning."""
    rows = ["| Flag | Environment variable | Default | Meaning |", "|---|---|---|---|"]
    for f in settings_fields():
        meta = f.metadata
        flags = ", ".join(f"`{flag}`" for flag in meta["flags"])
        if meta.get("repeat"):
            flags += " (repeatable)"
        meaning = meta["help"]
        if "choices" in meta:
            meaning += "; one of " + ", ".join(f"`{c}`" for c in meta["choices"])
        cells = [flags, f"`{env_name(f.name)}`", _shown_default(f), _cell(meaning)]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def with_flag_table(document: str) -> str:
    """``document`` with the text between the table markers replaced by the current table."""
    start, end = document.index(TABLE_START), document.index(TABLE_END)
    head = document[: start + len(TABLE_START)]
    return head + "\n" + flags_markdown() + document[end:]


def main(argv: list[str] | None = None) -> int:
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(
        prog="python -m mlx_server.config",
        description="Print the flag table in Markdown, or write it into a document between "
        "its markers.",
    )
    parser.add_argument("--markdown", action="store_true", help="print the table")
    parser.add_argument("--write", metavar="PATH", help="rewrite the table inside PATH")
    args = parser.parse_args(argv)
    if args.write:
        path = Path(args.write)
        path.write_text(with_flag_table(path.read_text()))
    if args.markdown or not args.write:
        print(flags_markdown(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
