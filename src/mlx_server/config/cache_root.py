"""Where the server keeps what it makes on disk."""

from __future__ import annotations

import os
import sys
from pathlib import Path


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
