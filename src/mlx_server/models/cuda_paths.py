"""What the server puts in place of MLX's and mlx-lm's own paths on a CUDA GPU, once a
model is loaded: the gated-delta kernel for linear attention (``gated_delta_cuda``) and
short queries' attention without a cuDNN graph per shape (``cuda_attention``). Elsewhere
nothing changes. Benchmarks that load a model themselves call it too, so that they time
what the server runs."""

from __future__ import annotations

from typing import Any

from mlx_server.models.cuda_attention import install as install_short_attention
from mlx_server.models.gated_delta_cuda import install as install_gated_delta


def install_cuda_paths(model: Any) -> list[str]:
    """Put them in place for ``model``; returns a line for the log for each one installed."""
    lines = []
    if (kernel := install_gated_delta(model)) is not None:
        lines.append(f"Linear attention: {kernel}")
    if (attention := install_short_attention()) is not None:
        lines.append(f"Attention: {attention}")
    return lines
