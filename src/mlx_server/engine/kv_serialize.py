"""KV states as safetensors arrays and metadata: the disk tier's file contents.

Plain (``KVCache``) and quantized (``QuantizedKVCache``) layers are supported, each cut to
the tokens it holds; other layer kinds (recurrent, rotating) are not written.
"""

from __future__ import annotations

import json
from typing import Any

FORMAT_VERSION = 1


def serialize(
    cache: list[Any], n_tokens: int
) -> tuple[dict[str, Any], dict[str, str], bool] | None:
    """Arrays and metadata for a KV state of plain or quantized KV layers, each cut to
    ``n_tokens``; None for other cache kinds (recurrent or rotating layers)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    arrays: dict[str, Any] = {}
    layers: list[dict[str, Any]] = []
    for i, c in enumerate(cache):
        if c.keys is None or c.offset != n_tokens:
            return None
        if type(c) is KVCache:
            parts = {"k": [c.keys], "v": [c.values]}
            layers.append({"type": "kv"})
        elif isinstance(c, QuantizedKVCache):
            parts = {"k": list(c.keys or ()), "v": list(c.values or ())}
            layers.append({"type": "quantized", "group_size": c.group_size, "bits": c.bits})
        else:
            return None
        for side, xs in parts.items():
            for j, x in enumerate(xs):
                if x.shape[-2] != n_tokens:
                    x = mx.contiguous(x[..., :n_tokens, :])
                arrays[f"{i}.{side}.{j}"] = x
    metadata = {"format": str(FORMAT_VERSION), "layers": json.dumps(layers)}
    return arrays, metadata, True


def deserialize(arrays: dict[str, Any], metadata: dict[str, str]) -> list[Any]:
    from mlx_lm.models.cache import KVCache

    from mlx_server.engine.kv_quant import BatchableQuantizedKVCache

    if metadata.get("format") != str(FORMAT_VERSION):
        raise ValueError(f"format {metadata.get('format')!r}")
    cache: list[Any] = []
    for i, layer in enumerate(json.loads(metadata["layers"])):
        if layer["type"] == "kv":
            c: Any = KVCache()
            c.keys, c.values = arrays[f"{i}.k.0"], arrays[f"{i}.v.0"]
        else:
            c = BatchableQuantizedKVCache(group_size=layer["group_size"], bits=layer["bits"])
            c.keys = tuple(arrays[f"{i}.k.{j}"] for j in range(3))
            c.values = tuple(arrays[f"{i}.v.{j}"] for j in range(3))
        c.offset = (c.keys[0] if isinstance(c.keys, tuple) else c.keys).shape[-2]
        cache.append(c)
    return cache
