"""What the start-up log says about the computation: the device, the BLAS library behind the
CPU's matmuls, and the dtype the weights run in. On Linux CPU these decide the speed
(float32 with OpenBLAS preloaded is several times faster than MLX's bundled reference BLAS,
docs/benchmarks.md), and nothing else in the log showed them. Also where the start's time
went, phase by phase (``START``), in one line before the readiness lines."""

from __future__ import annotations

import ctypes
import sys
import time
from collections import Counter
from typing import Any


class StartPhases:
    """Seconds per start-up phase, each from the previous mark (the first from when this
    module was imported: the command line's own import, before the heavy ones)."""

    def __init__(self) -> None:
        self._last = self._first = time.perf_counter()
        self.phases: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases = [*self.phases[-15:], (name, now - self._last)]
        self._last = now

    def line(self) -> str:
        """``Start: imports 3.1s, load 2.0s, ... (6.2s in all)``."""
        parts = ", ".join(f"{name} {secs:.1f}s" for name, secs in self.phases)
        return f"Start: {parts} ({self._last - self._first:.1f}s in all)"


START = StartPhases()


def openblas_version() -> str | None:
    """The OpenBLAS loaded into this process (``LD_PRELOAD`` from scripts/openblas.sh), or
    None. Asks the dynamic linker for OpenBLAS's own symbol, so a preload that failed (a
    wrong path) reads as absent."""
    try:
        process = ctypes.CDLL(None)
        config = process.openblas_get_config
    except (AttributeError, OSError, TypeError):
        return None
    config.restype = ctypes.c_char_p
    text = (config() or b"OpenBLAS").decode(errors="replace").split()
    return " ".join(text[:2])


def compute_line() -> str:
    """``Compute: cpu, BLAS: OpenBLAS 0.3.21 (preloaded)`` and the like."""
    import mlx.core as mx

    if mx.default_device().type == mx.DeviceType.gpu:
        backend = "Metal" if mx.metal.is_available() else "CUDA"
        return f"Compute: gpu ({backend})"
    return f"Compute: cpu, BLAS: {_cpu_blas()}"


def _cpu_blas() -> str:
    version = openblas_version()
    if version is not None:
        return f"{version} (preloaded)"
    if sys.platform == "darwin":
        return "Accelerate"
    return (
        "the reference BLAS bundled with mlx (float32 is several times slower than with "
        "OpenBLAS: apt-get install libopenblas0-pthread, then source scripts/openblas.sh)"
    )


def weights_dtype(model: Any) -> str:
    """The dtype most of the model's floating-point parameters hold (by element count);
    for a quantized model, what its scales and norms hold: the activations' dtype."""
    from mlx.utils import tree_flatten

    counts: Counter[str] = Counter()
    params: Any = tree_flatten(model.parameters())
    for _, value in params:
        dtype = getattr(value, "dtype", None)
        if dtype is not None and "float" in str(dtype):
            counts[str(dtype).rsplit(".", 1)[-1]] += int(value.size)
    return counts.most_common(1)[0][0] if counts else "unknown"


def weights_line(model: Any, config: dict[str, Any], dtype_flag: str | None) -> str:
    """``Weights: float32 (--dtype float32)``, ``Weights: 4-bit quantized, bfloat16
    activations`` and the like."""
    dtype = weights_dtype(model)
    bits = (config.get("quantization") or {}).get("bits")
    text = f"{bits}-bit quantized, {dtype} activations" if bits else dtype
    return f"Weights: {text}" + (f" (--dtype {dtype_flag})" if dtype_flag else "")
