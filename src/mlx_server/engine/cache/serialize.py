"""KV states as safetensors arrays and metadata: the disk tier's file contents.

Every cache kind is written through mlx-lm's own contract: a layer's ``state`` (arrays and
scalars, nested in lists and tuples) and its class, rebuilt with ``Class.from_state``, as
``mlx_lm.models.cache.save_prompt_cache`` / ``load_prompt_cache`` do. So plain, quantized,
rotating (sliding-window), recurrent (``ArraysCache``: Mamba, gated-delta, short
convolutions), chunked and nested (``CacheList``) layers all travel the same way. The one
kind-specific step is a space saving: plain and quantized KV layers are cut to the tokens
they hold (their buffers grow in steps of 256).

Format 2 stores each layer as ``{"class": name, "state": tree}``, where the tree's arrays
are named ``L<layer>.<path>`` in the file; format 1 files (plain and quantized KV only) are
not read.
"""

from __future__ import annotations

import json
from typing import Any

FORMAT_VERSION = 2


class Unsupported(ValueError):
    """A cache layer this format cannot hold (a class without mlx-lm's state contract)."""


def serialize(
    cache: list[Any], n_tokens: int
) -> tuple[dict[str, Any], dict[str, str], bool] | None:
    """Arrays, metadata and whether the state can be trimmed, for a KV state holding
    ``n_tokens`` tokens; None when a layer's token count says otherwise. Raises
    ``Unsupported`` for a layer whose class has no ``from_state``."""
    from mlx_lm.models.cache import can_trim_prompt_cache

    arrays: dict[str, Any] = {}
    layers: list[dict[str, Any]] = []
    for i, c in enumerate(cache):
        offset = getattr(c, "offset", None)
        if isinstance(offset, int) and offset != n_tokens:
            return None
        name = type(c).__name__
        if _class(name) is None:
            raise Unsupported(f"a {name} layer (no mlx-lm state contract)")
        layers.append({"class": name, "state": _encode(_compact(c), f"L{i}", arrays)})
    metadata = {"format": str(FORMAT_VERSION), "layers": json.dumps(layers)}
    return arrays, metadata, can_trim_prompt_cache(cache)


def deserialize(arrays: dict[str, Any], metadata: dict[str, str]) -> list[Any]:
    """The KV state ``serialize`` wrote (raises on another format or a damaged file)."""
    if metadata.get("format") != str(FORMAT_VERSION):
        raise ValueError(f"format {metadata.get('format')!r}")
    cache: list[Any] = []
    for layer in json.loads(metadata["layers"]):
        cls = _class(layer["class"])
        if cls is None:
            raise ValueError(f"unknown cache class {layer['class']!r}")
        cache.append(cls.from_state(_decode(layer["state"], arrays)))
    return cache


def _class(name: str) -> Any:
    """The cache class of that name: mlx-lm's, or this server's quantized one (a quantized
    layer comes back as the kind ``BatchGenerator`` can batch)."""
    from mlx_lm.models import cache as mlx_cache

    from mlx_server.engine.cache.kv_quant import BatchableQuantizedKVCache

    if name in ("QuantizedKVCache", "BatchableQuantizedKVCache"):
        return BatchableQuantizedKVCache
    if name == "DeltaKVCache":  # Qwen-VL's, with its position delta (cache/mrope.py)
        from mlx_server.engine.cache.mrope import DeltaKVCache

        return DeltaKVCache
    cls = getattr(mlx_cache, name, None)
    return cls if isinstance(cls, type) and hasattr(cls, "from_state") else None


def _compact(c: Any) -> Any:
    """A layer's state, plain and quantized KV buffers cut to the tokens they hold."""
    from mlx_lm.models.cache import CacheList, KVCache, QuantizedKVCache

    if isinstance(c, CacheList):
        return [(_compact(sub), type(sub).__name__) for sub in c.caches]
    if isinstance(c, (KVCache, QuantizedKVCache)) and c.keys is not None:
        n = c.offset
        state = list(c.state)
        state[0], state[1] = _cut(c.keys, n), _cut(c.values, n)
        return tuple(state)
    return c.state


def _cut(x: Any, n: int) -> Any:
    import mlx.core as mx

    if isinstance(x, (list, tuple)):
        return tuple(_cut(part, n) for part in x)
    return x if x.shape[-2] == n else mx.contiguous(x[..., :n, :])


def _encode(x: Any, path: str, arrays: dict[str, Any]) -> Any:
    """A JSON tree of ``x``: arrays go to ``arrays`` under their path, scalars stay."""
    import mlx.core as mx

    if isinstance(x, mx.array):
        arrays[path] = x
        return {"a": path}
    if isinstance(x, (list, tuple)):
        kind = "t" if isinstance(x, tuple) else "l"
        return {kind: [_encode(v, f"{path}.{i}", arrays) for i, v in enumerate(x)]}
    if x is None or isinstance(x, (bool, int, float, str)):
        return {"v": x}
    raise Unsupported(f"a {type(x).__name__} in a cache state")


def _decode(tree: dict[str, Any], arrays: dict[str, Any]) -> Any:
    if "a" in tree:
        return arrays[tree["a"]]
    if "t" in tree:
        return tuple(_decode(v, arrays) for v in tree["t"])
    if "l" in tree:
        return [_decode(v, arrays) for v in tree["l"]]
    return tree["v"]
