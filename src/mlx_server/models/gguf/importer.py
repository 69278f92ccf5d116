"""Import a GGUF file into an MLX model directory that `mlx_lm.load` serves.

    import_gguf(Path("model.Q4_0.gguf"), Path("models/model"))   # quantized, as in the file
    import_gguf(src, dest, dtype="float32")                       # dequantized
    import_cached(src)    # into the user cache, keyed by the file's SHA-256; instant next time

The directory gets `config.json` (with per-module `quantization` when kept quantized),
`model.safetensors`, `tokenizer.json`, `tokenizer_config.json` (chat template, special tokens,
`add_bos_token`) and `special_tokens_map.json`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.utils import make_shards
from tqdm import tqdm

from mlx_server.config import user_cache_root
from mlx_server.logs import log

from .config import model_config
from .reader import GGUFImportError, read_gguf
from .tokenizer import build_tokenizer
from .weights import (
    FLOAT_DTYPES,
    WeightPlan,
    check_complete,
    convert_modules,
    group_modules,
    quantization_config,
)

__all__ = ["GGUFImportError", "import_gguf", "import_cached", "cache_dir", "default_float_dtype"]


# Bump when the output of an import changes, so that cached imports are redone.
IMPORT_FORMAT = 1


def default_float_dtype() -> str:
    """Float dtype for scales and norms of a quantized import on this machine.

    MLX's CPU kernels run float16 many times slower than float32 (a 4-bit matmul with float16
    scales is ~30x slower), while GPUs want the halved memory traffic of float16.
    """
    cuda = getattr(mx, "cuda", None)
    gpu = mx.metal.is_available() or (cuda is not None and cuda.is_available())
    return "float16" if gpu else "float32"


def import_gguf(
    src: Path,
    dest: Path,
    *,
    dtype: str | None = None,
    progress: bool = True,
    float_dtype: str | None = None,
    _undo_qk_permutation: bool = True,
    _pre_tokenizer: str | None = None,
) -> Path:
    """Import the GGUF file `src` into the model directory `dest` and return `dest`.

    `dtype` (`float32`, `bfloat16`, `float16`) dequantizes every tensor; None keeps Q4_0,
    Q4_1 and Q8_0 tensors packed, each with its own bit width. `float_dtype` is the dtype of
    scales, biases and unquantized tensors of a quantized import (default: see
    `default_float_dtype`). `progress` shows a bar on stderr. Raises `GGUFImportError`.
    """
    src, dest = Path(src), Path(dest)
    for option in (dtype, float_dtype):
        if option is not None and option not in FLOAT_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(FLOAT_DTYPES)}, not {option!r}")
    contents = read_gguf(src)
    config = model_config(contents.metadata, contents.tensors)
    tokenizer = build_tokenizer(contents.metadata, pre_tokenizer=_pre_tokenizer)
    modules = group_modules(contents.tensors)
    check_complete(modules, config)
    plan = WeightPlan(config, dtype, float_dtype or default_float_dtype(), _undo_qk_permutation)
    weights = _convert(modules, plan, progress=progress, label=src.name)
    if dtype is None and (quantization := quantization_config(modules)) is not None:
        config["quantization"] = quantization
        config["quantization_config"] = quantization
    config["eos_token_id"] = tokenizer.eos_token_ids
    if (bos := contents.metadata.get("tokenizer.ggml.bos_token_id")) is not None:
        config["bos_token_id"] = int(bos)
    dest.mkdir(parents=True, exist_ok=True)
    _save_weights(dest, weights)
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save(dest)
    return dest


def _convert(
    modules: dict[str, dict[str, mx.array]], plan: WeightPlan, *, progress: bool, label: str
) -> dict[str, mx.array]:
    """Convert module by module, evaluating each so the bar shows real progress."""
    weights: dict[str, mx.array] = {}
    bar = tqdm(
        convert_modules(modules, plan),
        total=len(modules),
        desc=f"Importing {label}",
        unit="tensor",
        file=sys.stderr,
        disable=not progress,
    )
    for path, params in bar:
        mx.eval(list(params.values()))
        weights.update({f"{path}.{name}": array for name, array in params.items()})
    return weights


def _save_weights(dest: Path, weights: dict[str, mx.array]) -> None:
    """`model.safetensors`, or shards plus an index for models over mlx-lm's shard size."""
    shards = make_shards(weights)
    if len(shards) == 1:
        mx.save_safetensors(str(dest / "model.safetensors"), shards[0], metadata={"format": "mlx"})
        return
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(dest / name), shard, metadata={"format": "mlx"})
        weight_map.update(dict.fromkeys(shard, name))
    index = {
        "metadata": {"total_size": sum(w.nbytes for w in weights.values())},
        "weight_map": dict(sorted(weight_map.items())),
    }
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def cache_dir() -> Path:
    """The server's cache root (``config.user_cache_root``), where imports are kept."""
    return user_cache_root()


def import_cached(src: Path, *, dtype: str | None = None) -> Path:
    """Import `src` once into `cache_dir()/gguf/<sha256>/<variant>` and return that directory.

    The variant names the dtype choice (and import format), so a float32 and a quantized
    import of one file live side by side. The import goes to a temporary directory renamed
    into place, so an interrupted import leaves nothing half-written behind.
    """
    src = Path(src)
    variant = f"v{IMPORT_FORMAT}-{dtype or 'quantized-' + default_float_dtype()}"
    target = cache_dir() / "gguf" / file_sha256(src) / variant
    if target.is_dir():
        return target
    log(f"Importing {src} into {target}")
    return import_atomically(src, target, dtype=dtype)


def import_atomically(src: Path, target: Path, *, dtype: str | None = None) -> Path:
    """Import into a temporary sibling of `target`, then rename it into place.

    Readers never see a half-written model, and when two processes race, the first rename
    wins and the other import is discarded.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        import_gguf(src, staging, dtype=dtype)
        staging.chmod(0o755)  # mkdtemp makes it private
        os.rename(staging, target)
    except OSError:
        if not target.is_dir():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def file_sha256(path: Path) -> str:
    """SHA-256 of the file's content, remembered per (path, size, mtime) in the cache.

    Hashing a multi-gigabyte file takes seconds, so an unchanged file is not hashed again.
    """
    path = Path(path).resolve()
    try:
        stat = path.stat()
    except OSError as exc:
        raise GGUFImportError(f"cannot read {path}: {exc}") from exc
    index_path = cache_dir() / "gguf" / "hashes.json"
    key = f"{path}:{stat.st_size}:{stat.st_mtime_ns}"
    index = _read_json(index_path)
    if isinstance(index.get(key), str):
        return index[key]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    index[key] = digest.hexdigest()
    _write_json_atomic(index_path, index)
    return index[key]


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".hashes-", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
