"""How the memory of the machine is shared: sized from what is there, not a fixed fraction.

At start the device's usable memory (Metal's recommended working set, a CUDA GPU's memory,
or three quarters of the RAM on a CPU), minus the weights actually loaded, minus a margin for
activations and the runtime, is what the running requests' KV, the prefix cache's RAM tier
and MLX's buffer cache share. KV is counted per layer kind: a full-attention layer grows with
the context, a sliding-window layer holds at most its window, and a recurrent (linear
attention, Mamba, short convolution) layer a fixed state; layers that share another layer's
KV hold none.

Everything here is a pure function of (device, weights, model config, flags), so the sizing
for a 16 GB Mac or an H200 is tested on any machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

GiB = 1 << 30
MiB = 1 << 20
# Activations of a prefill chunk, the runtime's own buffers, the server's Python heap.
MIN_MARGIN = 512 * MiB
MARGIN_FRACTION = 0.05
# Below this a budget cannot hold a useful conversation: the model does not fit.
MIN_CONTEXT = 512

_FULL = "full"
_SLIDING = "sliding"
_RECURRENT = "recurrent"
_SHARED = "shared"


@dataclass(frozen=True)
class Device:
    """The memory a process may use on one device."""

    kind: str  # "metal", "cuda" or "cpu"
    total: int  # bytes the device has
    usable: int  # bytes this process should plan with

    def describe(self) -> str:
        what = {
            "metal": "Metal recommended working set",
            "cuda": "GPU memory",
            "cpu": "3/4 of RAM",
        }.get(self.kind, self.kind)
        return f"{_gib(self.usable)} ({what})"


def device_from_info(info: dict[str, Any], kind: str, ram_bytes: int) -> Device:
    """The device from MLX's ``device_info()`` (Metal: ``memory_size`` and
    ``max_recommended_working_set_size``; CUDA: ``total_memory``), else the RAM."""
    if kind == "metal":
        total = int(info.get("memory_size") or ram_bytes)
        usable = int(info.get("max_recommended_working_set_size") or total * 2 // 3)
        return Device("metal", total, usable)
    if kind == "cuda":
        total = int(info.get("total_memory") or info.get("memory_size") or 0)
        if total > 0:
            return Device("cuda", total, total)
    return Device("cpu", ram_bytes, ram_bytes * 3 // 4)


def read_device() -> Device:
    """This process's device (MLX's default one)."""
    import mlx.core as mx

    kind = "cpu"
    info: dict[str, Any] = {}
    if mx.default_device().type == mx.DeviceType.gpu:
        cuda = getattr(mx, "cuda", None)
        kind = "cuda" if cuda is not None and cuda.is_available() else "metal"
        try:
            info = dict(mx.device_info() if hasattr(mx, "device_info") else {})
            if not info and kind == "metal":
                info = dict(mx.metal.device_info())
        except Exception:
            info = {}
    return device_from_info(info, kind, ram_bytes())


def ram_bytes() -> int:
    """Physical memory; 8 GiB when the platform does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 8 * GiB


@dataclass(frozen=True)
class KVShape:
    """KV bytes of one sequence: ``per_token`` for each context token, plus ``per_sequence``
    whatever the length (sliding windows at their full size, recurrent states)."""

    per_token: int
    per_sequence: int = 0

    def bytes_for(self, n_tokens: int) -> int:
        return self.per_token * max(0, n_tokens) + self.per_sequence


def layer_kinds(config: dict[str, Any]) -> list[str]:
    """What each layer keeps: "full" (KV for every token), "sliding" (its window), "recurrent"
    (a fixed state) or "shared" (nothing: it reads another layer's KV). Read from the fields
    the families use: ``layer_types`` (Qwen3.5/Next, Gemma 3/4, gpt-oss, LFM2, OLMo 3, Granite
    4), ``hybrid_override_pattern`` (Nemotron-H), ``full_attn_interval``,
    ``sliding_window_pattern``, ``num_kv_shared_layers`` (Gemma 4)."""
    cfg = config.get("text_config", config)
    n = int(cfg.get("num_hidden_layers", 0) or 0)
    kinds = [_FULL] * n
    types = cfg.get("layer_types")
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(types, list) and types:
        kinds = [_kind_of_type(str(t)) for t in types]
    elif isinstance(pattern, str) and pattern:
        # Nemotron-H: "M" Mamba, "*" attention, "-" and "E" feed-forward only (no cache).
        kinds = [_RECURRENT if c == "M" else _FULL for c in pattern if c in "M*"]
    elif cfg.get("full_attn_interval"):
        every = int(cfg["full_attn_interval"])
        kinds = [_FULL if (i + 1) % every == 0 else _RECURRENT for i in range(n)]
    elif cfg.get("sliding_window_pattern") and cfg.get("sliding_window"):
        every = int(cfg["sliding_window_pattern"])
        kinds = [_FULL if (i + 1) % every == 0 else _SLIDING for i in range(n)]
    shared = int(cfg.get("num_kv_shared_layers", 0) or 0)
    if 0 < shared < len(kinds):
        kinds = kinds[: len(kinds) - shared] + [_SHARED] * shared
    return kinds


def _kind_of_type(t: str) -> str:
    t = t.lower()
    if "sliding" in t or t == "local":
        return _SLIDING
    if any(k in t for k in ("linear", "mamba", "conv", "recurrent", "ssm")):
        return _RECURRENT
    return _FULL


def kv_shape(config: dict[str, Any], per_token_all_layers: int) -> KVShape:
    """The KV shape of a model whose every layer would cost ``per_token_all_layers / layers``
    bytes per token (``base.kv_bytes_per_token``), by its layers' kinds."""
    cfg = config.get("text_config", config)
    kinds = layer_kinds(config)
    n = len(kinds) or 1
    per_layer = per_token_all_layers // max(1, int(cfg.get("num_hidden_layers", n) or n))
    window = int(cfg.get("sliding_window", 0) or 0)
    full = kinds.count(_FULL)
    sliding = kinds.count(_SLIDING)
    recurrent = kinds.count(_RECURRENT)
    if sliding and not window:  # a sliding kind without a size: count it in full
        full, sliding = full + sliding, 0
    # A recurrent state is of the order of a few hundred tokens of one layer's KV.
    fixed = per_layer * (sliding * window + recurrent * 256)
    return KVShape(per_layer * full, fixed)


@dataclass(frozen=True)
class MemoryPlan:
    """How the device's memory is shared; see the module docstring."""

    device: Device
    weights: int
    margin: int
    budget: int  # KV, the prefix cache's RAM tier and MLX's buffer cache together
    kv: KVShape
    ctx_size: int
    given: bool = False  # --kv-budget-gb set the budget

    @property
    def longest_context(self) -> int:
        """The most tokens one request can have within the budget."""
        if self.kv.per_token <= 0:
            return self.ctx_size if self.budget >= self.kv.per_sequence else 0
        return max(0, (self.budget - self.kv.per_sequence) // self.kv.per_token)

    @property
    def full_context_requests(self) -> int:
        """How many requests of the whole context fit in the budget at once."""
        return self.budget // max(1, self.kv.bytes_for(self.ctx_size))

    @property
    def fits(self) -> bool:
        """Whether the weights leave room for at least a short conversation."""
        return self.given or self.longest_context >= min(MIN_CONTEXT, self.ctx_size)

    def refusal(self) -> str:
        """Why the model cannot be served, naming the sizes."""
        return (
            f"the model's weights ({_gib(self.weights)}) and a margin of {_gib(self.margin)} "
            f"leave {_gib(max(0, self.budget))} of the {self.device.describe()} for the KV "
            f"cache: not enough for {min(MIN_CONTEXT, self.ctx_size)} tokens. Use a smaller "
            "or more quantized model, or set --kv-budget-gb to serve it anyway (the system "
            "will swap)"
        )

    def line(self) -> str:
        """The start-up line: weights, budget, the longest context, full-context requests."""
        source = "--kv-budget-gb" if self.given else f"{self.device.describe()} less weights"
        longest = self.longest_context
        ctx = f"{self.ctx_size} tokens"
        if longest < self.ctx_size:
            ctx += f" (only {longest} fit in the budget: longer requests are refused)"
        return (
            f"Memory: weights {_gib(self.weights)}, budget {_gib(self.budget)} ({source}, "
            f"margin {_gib(self.margin)}) for KV, the prefix cache and buffers; context {ctx}; "
            f"{self.full_context_requests} full-context requests fit at once"
        )


def plan_memory(
    device: Device,
    weights: int,
    kv: KVShape,
    ctx_size: int,
    budget_override: int | None = None,
) -> MemoryPlan:
    """The plan for ``weights`` bytes of loaded weights on ``device``; ``budget_override``:
    ``--kv-budget-gb``, taken as given."""
    margin = max(MIN_MARGIN, int(device.usable * MARGIN_FRACTION))
    if budget_override is not None:
        return MemoryPlan(device, weights, margin, budget_override, kv, ctx_size, given=True)
    budget = device.usable - weights - margin
    return MemoryPlan(device, weights, margin, budget, kv, ctx_size)


def weights_bytes(model: Any) -> int:
    """Bytes of the model's parameters as loaded (quantized weights at their packed size)."""
    from mlx.utils import tree_flatten

    leaves: Any = tree_flatten(model.parameters())
    return sum(int(v.nbytes) for _, v in leaves)


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n // MiB} MiB"
