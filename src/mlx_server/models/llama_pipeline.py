"""Pipeline parallelism for mlx-lm's Llama models, which mlx-lm shards only by tensor.

mlx-lm's own pipelined models (``models/pipeline.py``'s ``PipelineMixin``: Qwen2, Qwen3-MoE,
DeepSeek ...) keep a rank's share of the layers and pass the hidden state between ranks in
their model's forward pass. ``LlamaModel`` has no such pass, so this module does the same
from the outside, by the same rules: ranks split the layers evenly, the last rank runs the
first layers and rank 0 the last ones; a rank receives the hidden state from the rank above
before its first layer, sends it to the rank below after its last one, and every rank ends
with rank 0's output (``all_gather``) so that all of them compute the same logits.

Only the rank's own layers stay in ``model.model.layers``, so the KV cache (``make_cache``)
holds those alone, and the attention masks are built from the first of them. This relies on
``LlamaModel``'s attributes (``layers``, ``fa_idx``, ``swa_idx``) and its layer call
``layer(h, mask, cache=c)``: tests/engine/test_mlx_lm_contract.py checks them.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn


def supports(model: Any) -> bool:
    """Whether ``model`` is an mlx-lm model built on ``llama.LlamaModel``."""
    from mlx_lm.models.llama import LlamaModel

    return isinstance(getattr(model, "model", None), LlamaModel)


def layer_split(n_layers: int, size: int) -> list[int]:
    """Layers per rank, rank 0 first (the low ranks take the extra ones, as mlx-lm does)."""
    base, extra = divmod(n_layers, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


class _Stage(nn.Module):
    """One of the rank's layers, with the hand-over to the neighbouring ranks around it."""

    def __init__(self, layer: Any, group: Any, *, first: bool, last: bool):
        super().__init__()
        self.layer = layer
        self.use_sliding = bool(getattr(layer, "use_sliding", False))
        self._group = group
        self._first = first
        self._last = last

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        group = self._group
        rank, size = group.rank(), group.size()
        if self._first and rank < size - 1:
            x = mx.distributed.recv_like(x, rank + 1, group=group)
        h = self.layer(x, mask, cache=cache)
        if not self._last:
            return h
        if rank != 0:
            h = mx.distributed.send(h, rank - 1, group=group)
            # A prefill evaluates only the KV cache: tie the send to it, so it happens.
            if cache is not None and isinstance(getattr(cache, "keys", None), mx.array):
                cache.keys = mx.depends(cache.keys, h)
        return mx.distributed.all_gather(h, group=group)[: h.shape[0]]


def pipeline(model: Any, group: Any) -> None:
    """Keep this rank's layers of ``model`` (an mlx-lm Llama) and wire it into the pipeline
    of ``group``. Call before the weights are evaluated: the other layers are never read."""
    inner = model.model
    layers = list(inner.layers)
    split = layer_split(len(layers), group.size())
    rank = group.rank()
    start = sum(split[rank + 1 :])
    mine = layers[start : start + split[rank]]
    inner.layers = [
        _Stage(layer, group, first=i == 0, last=i == len(mine) - 1) for i, layer in enumerate(mine)
    ]
    # The masks come from the first local layer of each kind (the indices were global).
    kinds = [stage.use_sliding for stage in inner.layers]
    inner.fa_idx = kinds.index(False) if False in kinds else 0
    inner.swa_idx = kinds.index(True) if True in kinds else None
