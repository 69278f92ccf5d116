"""The encoder's weights run in float32 on the CPU (half-precision CPU kernels are slow), in
their stored dtype on a GPU, and in the dtype asked for when one is."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
from embedding_support import embedding_demo_dir
from mlx.utils import tree_flatten

from mlx_server.models.embedding import load_encoder


def _dtypes(model) -> set:
    return {v.dtype for _, v in tree_flatten(model.parameters())}


def _bfloat16_copy(tmp_path: Path) -> Path:
    """The demo model with its weights stored in bfloat16."""
    src = embedding_demo_dir()
    dest = tmp_path / "bf16"
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("model.safetensors"))
    weights = mx.load(str(src / "model.safetensors"))
    mx.save_safetensors(
        str(dest / "model.safetensors"), {k: v.astype(mx.bfloat16) for k, v in weights.items()}
    )
    return dest


def test_half_precision_weights_run_in_float32_on_the_cpu_only(tmp_path):
    enc = load_encoder(_bfloat16_copy(tmp_path), model_id="bf16")
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    assert _dtypes(enc.model) == ({mx.float32} if on_cpu else {mx.bfloat16})


def test_an_explicit_dtype_is_kept(tmp_path):
    enc = load_encoder(_bfloat16_copy(tmp_path), model_id="bf16", dtype="bfloat16")
    assert _dtypes(enc.model) == {mx.bfloat16}
