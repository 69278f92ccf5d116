"""One cache root per platform for everything the server keeps (GGUF imports, the prefix
cache's disk tier): ~/Library/Caches/mlx-server on macOS, ~/.cache/mlx-server elsewhere."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mlx_server.config import user_cache_root
from mlx_server.engine.cache.disk import default_root
from mlx_server.models.gguf.importer import cache_dir

pytestmark = pytest.mark.tiny


@pytest.fixture
def home(monkeypatch, tmp_path) -> Path:
    for name in ("MLX_SERVER_CACHE", "XDG_CACHE_HOME", "MLX_SERVER_PROMPT_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize(
    ("platform", "parts"),
    [("darwin", ("Library", "Caches", "mlx-server")), ("linux", (".cache", "mlx-server"))],
)
def test_every_cache_lives_under_the_platforms_root(home, monkeypatch, platform, parts) -> None:
    monkeypatch.setattr(sys, "platform", platform)
    root = home.joinpath(*parts)
    assert user_cache_root() == root
    assert cache_dir() == root  # GGUF imports
    assert default_root() == root / "prompt-cache"


def test_the_environment_moves_the_root(home, monkeypatch) -> None:
    monkeypatch.setenv("MLX_SERVER_CACHE", str(home / "elsewhere"))
    assert default_root() == home / "elsewhere" / "prompt-cache"
    assert cache_dir() == home / "elsewhere"
