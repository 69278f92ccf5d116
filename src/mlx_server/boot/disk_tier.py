"""The prefix cache's disk tier as the settings ask for it: its folder per model and KV
layout, or why it is off."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mlx_server.config import Settings
from mlx_server.engine.cache.disk import DiskPromptCache, default_root, model_cache_dir
from mlx_server.engine.cache.folder_lock import FolderLocked
from mlx_server.logs import log
from mlx_server.models.loader import activation_bytes

# A server restarted while the old process still writes its last entries (at most a few
# seconds: the engine's shutdown is bounded) waits this long for the disk tier's folder.
_DISK_LOCK_WAIT_S = 10.0


def disk_tier(loaded: Any, settings: Settings) -> tuple[Any, str]:
    """The prefix cache's disk tier (``--prompt-cache-dir``), or None and why it is off."""
    if settings.prompt_cache_dir == "":
        return None, "turned off (--prompt-cache-dir '')"
    if settings.prompt_cache_size <= 0:
        return None, "no prefix cache (--prompt-cache-size 0)"
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
        disk = DiskPromptCache(
            directory,
            int(settings.prompt_cache_disk_gb * (1 << 30)),
            lock_wait_s=_DISK_LOCK_WAIT_S,
        )
    except FolderLocked as e:
        reason = f"{directory} is in use by {_holder(e.pid)}"
        log(
            f"Warning: prompt cache disk tier off: {reason}; this server keeps its prefix cache "
            "in RAM only and leaves that directory alone (give each server its own "
            "--prompt-cache-dir to give each a disk tier)"
        )
        return None, reason
    except OSError as e:
        log(f"Prompt cache: disk tier off, cannot use {directory}: {e}")
        return None, f"cannot use {directory}: {e}"
    stats = disk.stats()
    log(
        f"Prompt cache disk tier: {directory} ({stats['prompt_cache_disk_entries']} entries, "
        f"{stats['prompt_cache_disk_bytes'] >> 20}MB, limit {settings.prompt_cache_disk_gb:g}GB)"
    )
    return disk, ""


def _holder(pid: int | None) -> str:
    if pid is None:
        return "another process"
    if pid == os.getpid():  # another model loaded from the same files
        return f"another model of this process (pid {pid})"
    return f"another process (pid {pid})"
