"""Which models are offered: each ``--model`` and every model found under ``--models-dir``
(MLX model directories, ``.gguf`` files, Hugging Face hub cache entries), each under a
stable id."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mlx_server.config import Settings
from mlx_server.logs import log


@dataclass(frozen=True)
class Offer:
    """One offered model: its id, where it is, what kind it is and its size on disk."""

    id: str
    path: str
    kind: str  # "chat", "vision" or "embedding"
    disk_bytes: int


def discover(settings: Settings) -> list[Offer]:
    """The offered models, ``--model`` ones first (the first is the default), in a stable
    order; a second model under an id already taken is skipped with a log line."""
    from mlx_server.models.loader import default_model_id

    found: list[tuple[str, Path]] = []
    for i, model in enumerate(settings.model_paths):
        mid = settings.model_id if i == 0 and settings.model_id else default_model_id(model)
        found.append((mid, Path(model).expanduser()))
    if settings.models_dir:
        found += scan_dir(Path(settings.models_dir).expanduser())
    offers: dict[str, Offer] = {}
    for mid, path in found:
        if mid in offers:
            log(f"Models: {path} skipped, the id {mid!r} is taken by {offers[mid].path}")
            continue
        offers[mid] = Offer(mid, str(path), model_kind(path), disk_size(path))
    return list(offers.values())


def scan_dir(root: Path) -> list[tuple[str, Path]]:
    """(id, path) of the models directly under ``root``: MLX directories by their name,
    ``.gguf`` files by their stem, hub cache entries (``models--org--name``) as ``org/name``."""
    if not root.is_dir():
        raise ValueError(f"--models-dir: {root} is not a directory")
    out: list[tuple[str, Path]] = []
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        if entry.name.startswith("."):
            continue
        if entry.is_file() and entry.suffix.lower() == ".gguf":
            out.append((entry.stem, entry))
        elif entry.is_dir() and entry.name.startswith("models--"):
            snapshot = hub_snapshot(entry)
            if snapshot is not None:
                out.append((entry.name.removeprefix("models--").replace("--", "/", 1), snapshot))
        elif entry.is_dir() and (entry / "config.json").is_file():
            out.append((entry.name, entry))
    return out


def hub_snapshot(entry: Path) -> Path | None:
    """A hub cache entry's snapshot: the one ``refs/main`` names, else the newest."""
    snapshots = entry / "snapshots"
    ref = entry / "refs" / "main"
    if ref.is_file():
        named = snapshots / ref.read_text(encoding="utf-8").strip()
        if (named / "config.json").is_file():
            return named
    if not snapshots.is_dir():
        return None
    usable = [s for s in snapshots.iterdir() if (s / "config.json").is_file()]
    return max(usable, key=lambda s: s.stat().st_mtime) if usable else None


def model_kind(path: Path) -> str:
    """chat, vision or embedding, by the model's config (a .gguf file is a chat model)."""
    if path.is_file():
        return "chat"
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return "chat"
    if not isinstance(config, dict):
        return "chat"
    from mlx_server.models.embedding import is_encoder_model
    from mlx_server.models.vision import is_vision_config

    if is_vision_config(config):
        return "vision"
    return "embedding" if is_encoder_model(path) else "chat"


def disk_size(path: Path) -> int:
    """Bytes of the weights on disk: what a load is expected to take before it is measured."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.glob("*.safetensors") if f.is_file())
