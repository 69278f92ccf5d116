"""Reading a GGUF file into MLX arrays and plain-Python metadata.

MLX parses GGUF natively (`mx.load`). It keeps Q4_0, Q4_1 and Q8_0 tensors quantized (each
comes back as `name.weight` packed uint32 plus `name.scales` and `name.biases`) and expands
F16, BF16, Q2_K and Q6_K to float16. It also expands Q4_K, but wrongly (MLX 0.32 gives every
second 32-value sub-block wrong values), fails tersely on other types, or drops a tensor
without a word. So the tensor table is scanned first and every type outside the verified set
is refused with a `GGUFImportError` naming it.
"""

from __future__ import annotations

import mmap
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from gguf import GGMLQuantizationType

GGUF_MAGIC = b"GGUF"

# GGML tensor types imported; the first group stays quantized, the second is read as float.
KEPT_QUANTIZED = ("Q4_0", "Q4_1", "Q8_0")
READ_AS_FLOAT = ("F32", "F16", "BF16", "Q2_K", "Q6_K")
READABLE_TYPES = KEPT_QUANTIZED + READ_AS_FLOAT

# Byte sizes of GGUF metadata scalar types, by type id (8 is string, 9 is array).
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


class GGUFImportError(Exception):
    """A GGUF file that cannot be imported: unreadable, truncated, or not supported."""


@dataclass(frozen=True)
class GGUFContents:
    """The tensors (MLX's naming: `.weight`, `.scales`, `.biases`) and metadata of a file."""

    tensors: dict[str, mx.array]
    metadata: dict[str, Any]
    tensor_types: dict[str, str]  # GGML type name of each tensor, as stored in the file


def read_gguf(path: Path) -> GGUFContents:
    """Load every tensor and metadata value of the GGUF file at `path`.

    Raises `GGUFImportError` for a file that is not GGUF, is truncated or corrupt, or holds a
    tensor type outside `READABLE_TYPES`.
    """
    types = scan_tensor_types(path)
    _refuse_unreadable(path, types)
    try:
        loaded = mx.load(str(path), return_metadata=True)
    except (RuntimeError, ValueError) as exc:
        raise GGUFImportError(f"{path} is truncated or corrupt: {exc}") from exc
    tensors, metadata = cast(tuple[dict[str, mx.array], dict[str, Any]], loaded)
    if missing := [name for name in types if name not in tensors]:
        raise GGUFImportError(f"{path}: MLX did not load {len(missing)} tensors, e.g. {missing[0]}")
    return GGUFContents(
        tensors=tensors,
        metadata={k: _plain(v) for k, v in metadata.items()},
        tensor_types=types,
    )


def scan_tensor_types(path: Path) -> dict[str, str]:
    """The GGML type name of every tensor, from the header alone (skipping the metadata).

    Much faster than `gguf.GGUFReader`, which decodes every vocabulary string.
    """
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _TableScanner(data, path).tensor_types()
    except ValueError as exc:  # mmap refuses an empty file
        raise GGUFImportError(f"{path} is not a GGUF file: {exc}") from exc
    except OSError as exc:
        raise GGUFImportError(f"cannot read {path}: {exc}") from exc


class _TableScanner:
    """Walks the GGUF header: magic, version, counts, metadata (skipped), tensor infos."""

    def __init__(self, data: mmap.mmap, path: Path) -> None:
        self.data, self.path, self.at = data, path, 0

    def tensor_types(self) -> dict[str, str]:
        if self.data[:4] != GGUF_MAGIC:
            raise GGUFImportError(f"{self.path} is not a GGUF file (it does not start with 'GGUF')")
        self.at = 4
        version = self._unpack("<I")
        if version not in (2, 3):
            raise GGUFImportError(f"{self.path}: GGUF version {version} is not supported (2, 3)")
        tensor_count, kv_count = self._unpack("<Q"), self._unpack("<Q")
        for _ in range(kv_count):
            self._skip_string()
            self._skip_value(self._unpack("<I"))
        types = {}
        for _ in range(tensor_count):
            name = self._string()
            dims = self._unpack("<I")
            self._advance(8 * dims)
            type_id = self._unpack("<I")
            self._advance(8)  # data offset
            types[name] = _type_name(type_id)
        return types

    def _unpack(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        self._check(size)
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += size
        return int(value)

    def _advance(self, size: int) -> None:
        self._check(size)
        self.at += size

    def _check(self, size: int) -> None:
        if self.at + size > len(self.data):
            raise GGUFImportError(
                f"{self.path} is truncated or corrupt: its header runs past the end of the file"
            )

    def _string(self) -> str:
        size = self._unpack("<Q")
        self._check(size)
        text = bytes(self.data[self.at : self.at + size]).decode("utf-8", errors="replace")
        self.at += size
        return text

    def _skip_string(self) -> None:
        self._advance(self._unpack("<Q"))

    def _skip_value(self, value_type: int) -> None:
        if value_type == _STRING:
            self._skip_string()
        elif value_type == _ARRAY:
            item_type, count = self._unpack("<I"), self._unpack("<Q")
            if item_type in _SCALAR_SIZES:
                self._advance(count * _SCALAR_SIZES[item_type])
            else:
                for _ in range(count):
                    self._skip_value(item_type)
        elif value_type in _SCALAR_SIZES:
            self._advance(_SCALAR_SIZES[value_type])
        else:
            raise GGUFImportError(
                f"{self.path} is truncated or corrupt: unknown metadata value type {value_type}"
            )


def _type_name(type_id: int) -> str:
    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return f"type {type_id}"


def _refuse_unreadable(path: Path, types: dict[str, str]) -> None:
    """Name the tensor types outside the supported set, with counts and an example."""
    unreadable = Counter(t for t in types.values() if t not in READABLE_TYPES)
    if not unreadable:
        return
    found = ", ".join(f"{name} ({count} tensors)" for name, count in sorted(unreadable.items()))
    example = next(name for name, t in types.items() if t in unreadable)
    raise GGUFImportError(
        f"{path} holds tensor types this import does not support: {found}, e.g. {example!r}. "
        f"Supported: {', '.join(KEPT_QUANTIZED)} (kept quantized) and "
        f"{', '.join(READ_AS_FLOAT)} (read as float). K-quant files such as Q4_K_M can be "
        "converted with llama.cpp: llama-quantize --allow-requantize IN.gguf OUT.gguf Q8_0 "
        "(or Q4_0)."
    )


def _plain(value: Any) -> Any:
    """Metadata as Python values: MLX hands numbers and numeric arrays back as `mx.array`."""
    if isinstance(value, mx.array):
        return value.item() if value.ndim == 0 else value.tolist()
    return value
