"""Reading a GGUF file into MLX arrays and plain-Python metadata.

MLX parses GGUF natively (`mx.load`). It keeps Q4_0, Q4_1 and Q8_0 tensors quantized (each
comes back as `name.weight` packed uint32 plus `name.scales` and `name.biases`), expands
F16, BF16, Q2_K, Q4_K and Q6_K to float16, and either fails with a terse message or silently
drops a tensor of any other type. This module turns all of those outcomes into a clear
`GGUFImportError` naming what is wrong.
"""

from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx

GGUF_MAGIC = b"GGUF"

# GGML tensor types MLX loads; the first group stays quantized, the second is expanded to float.
KEPT_QUANTIZED = ("Q4_0", "Q4_1", "Q8_0")
READ_AS_FLOAT = ("F32", "F16", "BF16", "Q2_K", "Q4_K", "Q6_K")
READABLE_TYPES = KEPT_QUANTIZED + READ_AS_FLOAT


class GGUFImportError(Exception):
    """A GGUF file that cannot be imported: unreadable, truncated, or not supported."""


@dataclass(frozen=True)
class GGUFContents:
    """The tensors (MLX's naming: `.weight`, `.scales`, `.biases`) and metadata of a file."""

    tensors: dict[str, mx.array]
    metadata: dict[str, Any]


def read_gguf(path: Path) -> GGUFContents:
    """Load every tensor and metadata value of the GGUF file at `path`.

    Raises `GGUFImportError` for a file that is not GGUF, is truncated or corrupt, or holds a
    tensor type MLX cannot read.
    """
    expected_tensors = _header_tensor_count(path)
    try:
        loaded = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as exc:
        raise GGUFImportError(_explain_load_failure(path, str(exc))) from exc
    tensors, metadata = cast(tuple[dict[str, mx.array], dict[str, Any]], loaded)
    if _base_tensor_count(tensors) != expected_tensors:
        # mx.load skips tensors of some types without a word; name them.
        raise GGUFImportError(_explain_load_failure(path, "some tensors were not loaded"))
    return GGUFContents(tensors=tensors, metadata={k: _plain(v) for k, v in metadata.items()})


def _header_tensor_count(path: Path) -> int:
    """Check the magic bytes and version, and return the tensor count the header declares."""
    try:
        with open(path, "rb") as f:
            header = f.read(24)
    except OSError as exc:
        raise GGUFImportError(f"cannot read {path}: {exc}") from exc
    if len(header) < 24 or header[:4] != GGUF_MAGIC:
        raise GGUFImportError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    version, tensor_count = struct.unpack("<IQ", header[4:16])
    if version not in (2, 3):
        raise GGUFImportError(f"{path}: GGUF version {version} is not supported (only 2 and 3)")
    return int(tensor_count)


def _base_tensor_count(tensors: dict[str, mx.array]) -> int:
    """Count file tensors: MLX adds `.scales` and `.biases` companions for quantized ones."""
    quantized = sum(1 for name in tensors if name.endswith(".scales"))
    return len(tensors) - 2 * quantized


def _explain_load_failure(path: Path, mlx_message: str) -> str:
    """Name the tensor types MLX cannot read, or pass on MLX's reason for a damaged file."""
    try:
        types = _tensor_types(path)
    except Exception:  # the gguf reader fails in its own ways on damaged files
        return f"{path} is truncated or corrupt: {mlx_message}"
    unreadable = Counter(t for t in types.values() if t not in READABLE_TYPES)
    if not unreadable:
        return f"{path} is truncated or corrupt: {mlx_message}"
    found = ", ".join(f"{name} ({count} tensors)" for name, count in sorted(unreadable.items()))
    example = next(name for name, t in types.items() if t in unreadable)
    return (
        f"{path} holds tensor types MLX cannot read: {found}, e.g. {example!r}. "
        f"Supported: {', '.join(KEPT_QUANTIZED)} (kept quantized) and "
        f"{', '.join(READ_AS_FLOAT)} (read as float). Convert the model to one of these, "
        "e.g. with llama.cpp's llama-quantize --allow-requantize ... Q8_0."
    )


def _tensor_types(path: Path) -> dict[str, str]:
    """Every tensor's GGML type name, read with the `gguf` package (slow; error path only)."""
    from gguf import GGUFReader

    return {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}


def _plain(value: Any) -> Any:
    """Metadata as Python values: MLX hands numbers and numeric arrays back as `mx.array`."""
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    return value
