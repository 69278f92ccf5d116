"""The start-up log says what the computation runs on: the device and BLAS (OpenBLAS
preloaded by scripts/openblas.sh, or MLX's bundled reference BLAS), and the weights' dtype,
before the readiness line Jan's launcher waits for."""

from __future__ import annotations

import glob
import os
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest
from support import free_port

from mlx_server.startup_report import weights_line

pytestmark = pytest.mark.tiny

READY = "[mlx] http server listening on"  # the line Jan's launcher waits for
OPENBLAS = sorted(
    glob.glob("/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0")
    + glob.glob("/usr/lib/*-linux-gnu/libopenblas.so.0")
)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)
        self.norm = nn.RMSNorm(64)


def test_weights_line_names_the_dtype_and_the_flag():
    model = _Tiny()
    model.set_dtype(mx.bfloat16)
    assert weights_line(model, {}, None) == "Weights: bfloat16"
    model.set_dtype(mx.float32)
    assert weights_line(model, {}, "float32") == "Weights: float32 (--dtype float32)"


def test_weights_line_of_a_quantized_model_names_bits_and_activations():
    model = _Tiny()
    model.set_dtype(mx.float16)
    nn.quantize(model, group_size=64, bits=4)
    line = weights_line(model, {"quantization": {"bits": 4, "group_size": 64}}, None)
    assert line == "Weights: 4-bit quantized, float16 activations"


def _start_lines(server_factory, model_dir, env: dict[str, str]) -> list[str]:
    port = free_port()
    args = ["-m", str(model_dir), "--port", str(port), "--ctx-size", "256", "--dtype", "float32"]
    sp = server_factory(args, env=env)
    ready = next(i for i, line in enumerate(sp.lines) if line.startswith(READY))
    return sp.lines[:ready]


def _line(lines: list[str], prefix: str) -> str:
    found = [line for line in lines if line.startswith(prefix)]
    assert len(found) == 1, lines
    return found[0]


def test_start_log_names_dtype_and_bundled_blas(server_factory, tiny_model_dir):
    env = {"LD_PRELOAD": ""}
    lines = _start_lines(server_factory, tiny_model_dir, env)
    assert _line(lines, "[mlx] Weights: ") == "[mlx] Weights: float32 (--dtype float32)"
    compute = _line(lines, "[mlx] Compute: ")
    if mx.default_device().type == mx.DeviceType.gpu:
        assert "BLAS" not in compute
    elif sys.platform == "linux":
        assert "reference BLAS bundled with mlx" in compute


@pytest.mark.skipif(
    sys.platform != "linux" or not OPENBLAS,
    reason="OpenBLAS is not installed (apt-get install libopenblas0-pthread)",
)
def test_start_log_names_preloaded_openblas(server_factory, tiny_model_dir):
    env = {"LD_PRELOAD": OPENBLAS[0]}
    compute = _line(_start_lines(server_factory, tiny_model_dir, env), "[mlx] Compute: ")
    if mx.default_device().type != mx.DeviceType.gpu:
        assert compute.startswith("[mlx] Compute: cpu, BLAS: OpenBLAS ")
        assert compute.endswith("(preloaded)")


def test_a_failed_preload_reads_as_absent(server_factory, tiny_model_dir, tmp_path):
    """A preload path that does not exist (the dynamic linker warns and goes on) is not
    reported as OpenBLAS."""
    if sys.platform != "linux" or mx.default_device().type == mx.DeviceType.gpu:
        pytest.skip("LD_PRELOAD and the CPU's BLAS are Linux CPU matters")
    env = {"LD_PRELOAD": os.fspath(tmp_path / "libopenblas.so.0")}
    compute = _line(_start_lines(server_factory, tiny_model_dir, env), "[mlx] Compute: ")
    assert "OpenBLAS 0" not in compute and "reference BLAS" in compute
