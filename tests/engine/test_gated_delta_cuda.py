"""The CUDA gated-delta kernel's installer (models/gated_delta_cuda.py), on the CPU: it changes
nothing off a CUDA GPU; where it acts, it patches exactly the mlx-lm modules whose layers call
``gated_delta_update``, only after a self-check passes, with a function that feeds the kernel
what mlx-lm computes. The kernel itself runs on a GPU only: bench/gpu/gated_delta.py checks it
there against mlx-lm's ``gated_delta_ops``."""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from arch_models import build
from mlx_lm.models import gated_delta as gd

from mlx_server.models import gated_delta_cuda as gdc
from mlx_server.models.loader import load_model

pytestmark = pytest.mark.tiny

# mlx-lm's model modules that import gated_delta_update by name, loaded so that a patch that
# reached too far would show in them.
CALLERS = ("qwen3_5", "qwen3_next", "kimi_linear", "olmo_hybrid", "bailing_moe_v3")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gdn")
    return {name: build(name, root / name) for name in ("qwen3_5", "qwen3_5_moe")}


@pytest.fixture
def restored(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    """Every mlx-lm module's ``gated_delta_update`` as it was, put back after the test."""
    for name in CALLERS:
        importlib.import_module(f"mlx_lm.models.{name}")
    before = {
        name: mod.gated_delta_update
        for name, mod in list(sys.modules.items())
        if name.startswith("mlx_lm.") and hasattr(mod, "gated_delta_update")
    }
    for name, fn in before.items():
        monkeypatch.setattr(sys.modules[name], "gated_delta_update", fn)
    return before


def changed(before: dict[str, object]) -> set[str]:
    return {name for name, fn in before.items() if sys.modules[name].gated_delta_update is not fn}


def parameters(fn: object) -> list[tuple[str, object, object]]:
    """Names, kinds and defaults (annotations aside: theirs are evaluated, ours are not)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]  # type: ignore[arg-type]


def stand_in(q, k, v, g, beta, state, mask=None):  # type: ignore[no-untyped-def]
    """A kernel that agrees with mlx-lm: its own step-by-step path."""
    return gd.gated_delta_ops(q, k, v, g, beta, state, mask)


def test_on_the_cpu_loading_and_installing_change_nothing(model_dirs, restored):
    assert not gdc.on_cuda_gpu()
    loaded = load_model(str(model_dirs["qwen3_5"]))
    assert gdc.modules_using(loaded.model), "the tiny Qwen3.5 has gated-delta layers"
    assert gdc.install(loaded.model, kernel=stand_in) is None
    assert changed(restored) == set()


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_install_patches_exactly_the_modules_whose_layers_call_it(
    model_dirs, restored, monkeypatch, family
):
    from mlx_lm import load

    model = load(str(model_dirs[family]))[0]
    tokens = mx.array([[5, 9, 3, 7, 11, 2]])
    before = model(tokens)
    monkeypatch.setattr(gdc, "on_cuda_gpu", lambda: True)

    line = gdc.install(model, kernel=stand_in)

    # Qwen3.5's layers come from qwen3_5 and qwen3_next (attention, MLP, norms), and both
    # import the name; only qwen3_5's GatedDeltaNet calls it.
    assert changed(restored) == {"mlx_lm.models.qwen3_5"}
    assert line is not None and "mlx_lm.models.qwen3_5" in line
    assert "qwen3_next" not in line
    patched = sys.modules["mlx_lm.models.qwen3_5"].gated_delta_update
    assert patched.mlx_server_kernel is stand_in
    assert parameters(patched) == parameters(gd.gated_delta_update)
    # On the CPU stream the patched function takes mlx-lm's path: the same logits.
    assert mx.array_equal(model(tokens), before)
    # A second model of the family: already in place, nothing patched twice.
    assert gdc.install(model, kernel=stand_in) == line
    assert sys.modules["mlx_lm.models.qwen3_5"].gated_delta_update is patched


def test_a_failing_self_check_leaves_the_model_untouched(model_dirs, restored, monkeypatch, capsys):
    from mlx_lm import load

    model = load(str(model_dirs["qwen3_5"]))[0]
    monkeypatch.setattr(gdc, "on_cuda_gpu", lambda: True)

    def off_by_two_percent(q, k, v, g, beta, state, mask=None):  # type: ignore[no-untyped-def]
        y, state = gd.gated_delta_ops(q, k, v, g, beta, state, mask)
        return y * 1.02, state

    def ignores_the_mask(q, k, v, g, beta, state, mask=None):  # type: ignore[no-untyped-def]
        return gd.gated_delta_ops(q, k, v, g, beta, state, None)

    def fails_to_build(*args):  # type: ignore[no-untyped-def]
        raise RuntimeError("nvrtc: error")

    for wrong in (off_by_two_percent, ignores_the_mask, fails_to_build):
        assert gdc.install(model, kernel=wrong) is None, wrong.__name__
        assert changed(restored) == set(), wrong.__name__
    warnings = [ln for ln in capsys.readouterr().out.splitlines() if "self-check" in ln]
    assert len(warnings) == 3
    assert "nvrtc: error" in warnings[2]


def test_the_self_check_passes_a_kernel_that_agrees():
    assert gdc.self_check(stand_in) is None


@pytest.mark.parametrize(
    ("options", "masked", "with_state", "vector_gate"),
    [
        ({}, False, True, False),
        ({}, True, False, False),
        ({"lower_bound": -5.0}, True, True, False),
        ({"allow_neg_eigval": True}, False, True, True),
    ],
)
def test_the_update_feeds_the_kernel_what_mlx_lm_computes(
    monkeypatch, options, masked, with_state, vector_gate
):
    """Where the kernel applies, the patched update hands it the gates mlx-lm derives (beta
    from b, g from A_log, a and dt_bias): the same result as mlx-lm's update."""
    seen = []

    def recording(q, k, v, g, beta, state, mask=None):  # type: ignore[no-untyped-def]
        seen.append(g.shape)
        return stand_in(q, k, v, g, beta, state, mask)

    monkeypatch.setattr(gdc, "kernel_applies", lambda q, v: True)
    update = gdc.make_update(recording)
    B, T, Hk, Hv, Dk, Dv = 2, 5, 2, 4, 32, 16
    ks = mx.random.split(mx.random.key(3), 8)
    q = mx.random.normal((B, T, Hk, Dk), key=ks[0]) * 0.2
    k = mx.random.normal((B, T, Hk, Dk), key=ks[1]) * 0.2
    v = mx.random.normal((B, T, Hv, Dv), key=ks[2])
    gate_shape = (B, T, Hv, Dk) if vector_gate else (B, T, Hv)
    a = mx.random.normal(gate_shape, key=ks[3])
    b = mx.random.normal((B, T, Hv), key=ks[4])
    A_log = mx.random.normal((Hv, 1) if vector_gate else (Hv,), key=ks[5])
    dt_bias = mx.random.normal((Hv, Dk) if vector_gate else (Hv,), key=ks[6])
    state = mx.random.normal((B, Hv, Dv, Dk), key=ks[7]) if with_state else None
    mask = mx.array([[False, True, True, True, True], [True] * 5]) if masked else None

    y, st = update(q, k, v, a, b, A_log, dt_bias, state, mask, **options)
    y_ref, st_ref = gd.gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, mask, **options)

    assert seen == [gate_shape], "the kernel ran, once, with mlx-lm's gate"
    assert mx.allclose(y, y_ref, atol=1e-6).item()
    assert mx.allclose(st, st_ref, atol=1e-6).item()


def test_where_the_kernel_does_not_apply_the_update_takes_mlx_lm_s_path():
    calls = []
    update = gdc.make_update(lambda *args: calls.append(args))
    q = k = mx.zeros((1, 2, 1, 32))
    v = mx.zeros((1, 2, 2, 8))
    a = b = mx.zeros((1, 2, 2))
    y, _ = update(q, k, v, a, b, mx.zeros((2,)), mx.zeros((2,)))
    assert calls == [] and y.shape == (1, 2, 2, 8)  # the CPU stream: no kernel
    assert not gdc.kernel_applies(q, v)


@pytest.mark.parametrize("vector_gate", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_kernel_source_is_complete(vector_gate, masked):
    src = gdc.kernel_source(vector_gate, masked)
    assert "@" not in src, "a placeholder was left"
    assert src.count("{") == src.count("}")
    assert src.count("(") == src.count(")")
    assert ("mask[" in src) == masked
    # Per-element gates are read per lane (32 apart), a scalar gate once per step.
    assert bool(re.search(r"g\[g0 \+ \(size_t\)tn \* g_step \+ 32 \* i\]", src)) == vector_gate
    # Lengths, head counts and value widths come from the shapes: one build per Dk.
    for read in ("T = v_shape[1]", "Hv = v_shape[2]", "Dv = v_shape[3]", "Hk = k_shape[2]"):
        assert read in src


@pytest.mark.parametrize("vector_gate", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_the_self_check_s_reference_is_mlx_lm_s_ops_path(masked, vector_gate):
    args = gdc._inputs(mx.random.key(11), mx.float32, 6, masked, vector_gate)
    y_ref, st_ref = gdc.reference(*args)
    y, st = gd.gated_delta_ops(*args)
    assert abs(np.array(y) - y_ref).max() < 1e-5
    assert abs(np.array(st) - st_ref).max() < 1e-5
