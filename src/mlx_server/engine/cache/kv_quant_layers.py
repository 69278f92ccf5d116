"""Which of a model's cache layers can hold a quantized KV cache (``--kv-bits``).

mlx-lm's quantized attention covers a plain attention layer only. It does not take
attention sinks (gpt-oss: "Quantized SDPA does not support attention sinks"); a layer whose
keys and values later layers reuse (Gemma 4's KV sharing) hands them on quantized to a
layer that expects plain arrays; a head dimension that is not a multiple of the group size
cannot be quantized at all; and sliding-window or recurrent layers have no quantized form
here. ``plan_layers`` finds, at start, the layers that can: by those rules, then by a trial
(a short prompt, a decode step alone and in a batch of two) whose failure is narrowed down
to the layers at fault. Those stay plain; a model with none left is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlx_server.engine.cache.kv_quant import quantize_layers

_TRIAL = [1, 2, 3, 4]  # token ids every vocabulary has


@dataclass
class LayerPlan:
    """The cache layers (by index) to quantize, and why each other one stays plain."""

    quantized: list[int]
    plain: dict[int, str] = field(default_factory=dict)

    def describe(self) -> str:
        """One line for the start-up log."""
        total = len(self.quantized) + len(self.plain)
        if not self.plain:
            return f"all {total} layers quantized"
        reasons: dict[str, list[int]] = {}
        for i, why in sorted(self.plain.items()):
            reasons.setdefault(why, []).append(i)
        kept = "; ".join(f"{_ranges(ix)}: {why}" for why, ix in reasons.items())
        return f"{len(self.quantized)} of {total} layers quantized; plain: {kept}"


def _ranges(ix: list[int]) -> str:
    return ("layer " if len(ix) == 1 else "layers ") + ", ".join(map(str, ix))


class NoQuantizableLayer(ValueError):
    """No layer of the model can hold a quantized KV cache."""


def plan_layers(model: Any, bits: int, group_size: int) -> LayerPlan:
    """The layers of ``model``'s cache to quantize (see the module docstring)."""
    cache = make_prompt_cache(model)
    plan = LayerPlan([], {})
    for i, c in enumerate(cache):
        if type(c) is KVCache:
            plan.quantized.append(i)
        else:
            plan.plain[i] = f"{type(c).__name__} (no quantized form)"
    _rule_out(plan, _head_dims(model, group_size), "head dimension")
    _rule_out(plan, _with_sinks(model, len(cache)), "attention sinks")
    _rule_out(plan, _shared_kv(model), "keys and values shared with later layers")
    if plan.quantized and _trial(model, plan, bits, group_size) is not None:
        _narrow(model, plan, bits, group_size)
    if not plan.quantized:
        reasons = plan.describe().split("plain: ", 1)[-1]
        hint = " (or give --kv-group-size a divisor of it)" if "head dimension" in reasons else ""
        raise NoQuantizableLayer(
            f"--kv-bits {bits}: no layer of this model can hold a quantized KV cache "
            f"({reasons}); drop --kv-bits{hint}"
        )
    return plan


def _rule_out(plan: LayerPlan, found: dict[int, str], what: str) -> None:
    for i, detail in found.items():
        if i in plan.quantized:
            plan.quantized.remove(i)
            plan.plain[i] = f"{what} {detail}".strip()


def _head_dims(model: Any, group_size: int) -> dict[int, str]:
    """Layers whose key or value head dimension is not a multiple of the group size,
    read from the cache after a plain forward pass of a few tokens."""
    cache = make_prompt_cache(model)
    model(mx.array(_TRIAL)[None], cache=cache)
    out: dict[int, str] = {}
    for i, c in enumerate(cache):
        if type(c) is KVCache and c.keys is not None and c.values is not None:
            dims = {c.keys.shape[-1], c.values.shape[-1]}
            if any(d % group_size for d in dims):
                shown = "/".join(map(str, sorted(dims)))
                out[i] = f"{shown}, not a multiple of the group size {group_size}"
    return out


def _decoder_layers(model: Any) -> list[Any]:
    for holder in (model, getattr(model, "model", None), getattr(model, "language_model", None)):
        layers = getattr(holder, "layers", None)
        if isinstance(layers, list):
            return layers
    return []


def _with_sinks(model: Any, n_cache: int) -> dict[int, str]:
    """Layers with attention sinks (when the cache has one layer per decoder layer)."""
    layers = _decoder_layers(model)
    if len(layers) != n_cache:
        return {}
    return {
        i: ""
        for i, layer in enumerate(layers)
        if any(_name(p).split(".")[-1] == "sinks" for p in tree_flatten(layer.parameters()))
    }


def _name(item: Any) -> str:
    return str(item[0])


def _shared_kv(model: Any) -> dict[int, str]:
    """Layers whose keys and values later layers reuse (mlx-lm's ``previous_kvs`` map)."""
    for holder in (model, getattr(model, "model", None), getattr(model, "language_model", None)):
        for inner in (holder, getattr(holder, "model", None)):
            previous = getattr(inner, "previous_kvs", None)
            if isinstance(previous, list):
                return {src: "" for j, src in enumerate(previous) if src != j}
    return {}


def quantized_cache(model: Any, plan: LayerPlan, bits: int, group_size: int) -> list[Any]:
    """A fresh cache for ``model`` with the plan's layers quantized."""
    return quantize_layers(make_prompt_cache(model), group_size, bits, plan.quantized)


def _trial(model: Any, plan: LayerPlan, bits: int, group_size: int) -> str | None:
    """Run a short prompt, a decode step, and a decode step of a batch of two on the
    plan's cache; the error, or None."""
    try:
        caches = []
        for _ in range(2):
            cache = quantized_cache(model, plan, bits, group_size)
            model(mx.array(_TRIAL)[None], cache=cache)
            mx.eval(model(mx.array([[_TRIAL[0]]]), cache=cache))
            caches.append(cache)
        batch = [type(layers[0]).merge(list(layers)) for layers in zip(*caches, strict=True)]
        mx.eval(model(mx.array([[_TRIAL[1]], [_TRIAL[2]]]), cache=batch))
    except Exception as e:  # whatever the model raises is the reason a layer stays plain
        return f"{type(e).__name__}: {e}"
    return None


def _narrow(model: Any, plan: LayerPlan, bits: int, group_size: int) -> None:
    """The trial failed: try each layer quantized alone, keep those that pass."""
    candidates, plan.quantized = plan.quantized, []
    for i in candidates:
        alone = LayerPlan([i], {})
        error = _trial(model, alone, bits, group_size)
        if error is None:
            plan.quantized.append(i)
        else:
            plan.plain[i] = f"the quantized attention fails ({error[:120]})"
    if plan.quantized and (error := _trial(model, plan, bits, group_size)) is not None:
        for i in plan.quantized:
            plan.plain[i] = f"the quantized attention fails together ({error[:120]})"
        plan.quantized = []
