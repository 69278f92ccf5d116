"""A CUDA kernel for the gated delta rule of linear-attention layers (Qwen3.5, Qwen3-Next, Kimi
Linear, Olmo hybrid, Bailing): mlx-lm's ``gated_delta_update`` has a Metal kernel, and on CUDA
falls back to ``gated_delta_ops``, a Python loop of one op chain per token, which makes a long
prompt's prefill take minutes on a GPU. ``install(model)`` puts this kernel in its place in the
mlx-lm model modules that the model uses, after a self-check against a NumPy copy of
``gated_delta_ops`` (``reference``).

The kernel follows mlx-lm's Metal one: one warp per value row (batch, value head, value
index), that row's ``Dk`` state values spread over the 32 lanes (lane ``l`` holds elements
``l, l + 32, ...``, so that the warp reads ``q`` and ``k`` coalesced), the time loop inside the
kernel, warp-shuffle sums for the two dot products per step. State in float32 registers, ``y``
in the input dtype, the final state in the state's dtype; a masked step leaves the state as it
was and writes a zero output. Importing this module is harmless anywhere: kernels are built on
first use, and ``install`` does nothing unless the default device is a CUDA GPU.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from types import CodeType, FunctionType, ModuleType
from typing import Any

from mlx_server.logs import log

Kernel = Callable[..., tuple[Any, Any]]

# The name mlx-lm's model modules import (``from .gated_delta import gated_delta_update``).
NAME = "gated_delta_update"

_HEADER = """
__device__ __forceinline__ float gdn_warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}
"""

# Placeholders (@NAME@) are filled per variant: with or without a mask, scalar gate
# ([B, T, Hv]) or one per key element ([B, T, Hv, Dk]). The next step's inputs are read
# while this step's sums run.
_SOURCE = """
  constexpr int NPL = Dk / 32;  // state elements per lane
  // Only Dk is built in: one build serves every head count, value width and length.
  const int T = v_shape[1];
  const int Hv = v_shape[2];
  const int Dv = v_shape[3];
  const int Hk = k_shape[2];
  const int lane = threadIdx.x;
  const int dv = blockIdx.y * blockDim.y + threadIdx.y;
  const int n = blockIdx.z;  // b * Hv + hv
  if (dv >= Dv) {
    return;  // the whole warp: threadIdx.y is one per warp
  }
  const int b = n / Hv;
  const int hv = n % Hv;
  const int hk = hv / (Hv / Hk);

  // q, k: [B, T, Hk, Dk]; v, y: [B, T, Hv, Dv]; beta: [B, T, Hv]; state: [B, Hv, Dv, Dk]
  const size_t qk_step = (size_t)Hk * Dk;
  const size_t v_step = (size_t)Hv * Dv;
  const size_t qk0 = ((size_t)b * T * Hk + hk) * Dk + lane;
  const size_t v0 = ((size_t)b * T * Hv + hv) * Dv + dv;
  const size_t beta0 = (size_t)b * T * Hv + hv;
@G_SETUP@
  const size_t row = ((size_t)n * Dv + dv) * Dk + lane;

  float s[NPL];
#pragma unroll
  for (int i = 0; i < NPL; ++i) {
    s[i] = static_cast<float>(state_in[row + 32 * i]);
  }

  float kn[NPL], qn[NPL], gn[@G_COUNT@];
  float vn = 0.0f, bn = 0.0f;
  bool on_n = true;
  if (T > 0) {
@LOAD_FIRST@
  }
  for (int t = 0; t < T; ++t) {
    float kc[NPL], qc[NPL], gc[@G_COUNT@];
#pragma unroll
    for (int i = 0; i < NPL; ++i) {
      kc[i] = kn[i];
      qc[i] = qn[i];
    }
#pragma unroll
    for (int i = 0; i < @G_COUNT@; ++i) {
      gc[i] = gn[i];
    }
    const float vc = vn, bc = bn;
    const bool on = on_n;
    if (t + 1 < T) {
      const int tn = t + 1;
@LOAD_NEXT@
    }
    if (on) {
      float kv = 0.0f;
#pragma unroll
      for (int i = 0; i < NPL; ++i) {
        s[i] *= @GATE@;
        kv += s[i] * kc[i];
      }
      kv = gdn_warp_sum(kv);
      const float delta = (vc - kv) * bc;
      float out = 0.0f;
#pragma unroll
      for (int i = 0; i < NPL; ++i) {
        s[i] += kc[i] * delta;
        out += s[i] * qc[i];
      }
      out = gdn_warp_sum(out);
      if (lane == 0) {
        y[v0 + (size_t)t * v_step] = static_cast<InT>(out);
      }
    } else if (lane == 0) {
      y[v0 + (size_t)t * v_step] = static_cast<InT>(0.0f);
    }
  }

#pragma unroll
  for (int i = 0; i < NPL; ++i) {
    state_out[row + 32 * i] = static_cast<StT>(s[i]);
  }
"""


def _load(t: str, vector_gate: bool, masked: bool) -> str:
    """The statements that read step ``t``'s inputs into the ``*n`` registers."""
    if vector_gate:
        gate = (
            "#pragma unroll\n"
            "      for (int i = 0; i < NPL; ++i) {\n"
            f"        gn[i] = static_cast<float>(g[g0 + (size_t){t} * g_step + 32 * i]);\n"
            "      }"
        )
    else:
        gate = f"      gn[0] = static_cast<float>(g[g0 + (size_t){t} * g_step]);"
    mask = f"      on_n = static_cast<bool>(mask[(size_t)b * T + {t}]);" if masked else ""
    lines = [
        "    {",
        f"      const size_t o = qk0 + (size_t){t} * qk_step;",
        "#pragma unroll",
        "      for (int i = 0; i < NPL; ++i) {",
        "        kn[i] = static_cast<float>(k[o + 32 * i]);",
        "        qn[i] = static_cast<float>(q[o + 32 * i]);",
        "      }",
        gate,
        f"      vn = static_cast<float>(v[v0 + (size_t){t} * v_step]);",
        f"      bn = static_cast<float>(beta[beta0 + (size_t){t} * Hv]);",
        mask,
        "    }",
    ]
    return "\n".join(line for line in lines if line)


def kernel_source(vector_gate: bool, masked: bool) -> str:
    """The kernel body of one variant (``mx.fast.cuda_kernel`` writes the signature)."""
    if vector_gate:  # g: [B, T, Hv, Dk]
        g_setup = (
            "  const size_t g_step = (size_t)Hv * Dk;\n"
            "  const size_t g0 = ((size_t)b * T * Hv + hv) * Dk + lane;"
        )
    else:  # g: [B, T, Hv]
        g_setup = "  const size_t g_step = (size_t)Hv;\n  const size_t g0 = beta0;"
    return (
        _SOURCE.replace("@G_SETUP@", g_setup)
        .replace("@G_COUNT@", "NPL" if vector_gate else "1")
        .replace("@GATE@", "gc[i]" if vector_gate else "gc[0]")
        .replace("@LOAD_FIRST@", _load("0", vector_gate, masked))
        .replace("@LOAD_NEXT@", _load("tn", vector_gate, masked))
    )


_kernels: dict[tuple[bool, bool], Any] = {}


def _kernel(vector_gate: bool, masked: bool) -> Any:
    key = (vector_gate, masked)
    if key not in _kernels:
        import mlx.core as mx

        inputs = ["q", "k", "v", "g", "beta", "state_in"] + (["mask"] if masked else [])
        suffix = ("_vec" if vector_gate else "") + ("_mask" if masked else "")
        _kernels[key] = mx.fast.cuda_kernel(
            name=f"mlx_server_gated_delta{suffix}",
            input_names=inputs,
            output_names=["y", "state_out"],
            source=kernel_source(vector_gate, masked),
            header=_HEADER,
        )
    return _kernels[key]


def gated_delta_kernel(q, k, v, g, beta, state, mask=None):  # type: ignore[no-untyped-def]
    """The recurrence on the GPU: ``q, k: [B, T, Hk, Dk]``, ``v: [B, T, Hv, Dv]``,
    ``g: [B, T, Hv]`` or ``[B, T, Hv, Dk]``, ``beta: [B, T, Hv]``, ``state: [B, Hv, Dv, Dk]``,
    ``mask: [B, T]`` or None. Returns ``y: [B, T, Hv, Dv]`` (q's dtype) and the new state
    (state's dtype), as mlx-lm's ``gated_delta_kernel``. Needs ``Dk`` a multiple of 32 and
    ``Hv`` a multiple of ``Hk``."""
    import mlx.core as mx

    B, T, Hk, Dk = k.shape
    Hv, Dv = v.shape[2:]
    inputs = [q, k, v, g, beta, state]
    if mask is not None:
        inputs.append(mask if mask.dtype == mx.bool_ else mask.astype(mx.bool_))
    kernel = _kernel(g.ndim == 4, mask is not None)
    y, new_state = kernel(
        inputs=inputs,
        # Every input's dtype names the build (MLX keys built kernels by name), though the
        # source only spells the two outputs'.
        template=[
            ("InT", q.dtype),
            ("StT", state.dtype),
            ("KT", k.dtype),
            ("VT", v.dtype),
            ("GT", g.dtype),
            ("BT", beta.dtype),
            ("Dk", Dk),
        ],
        grid=(32, Dv, B * Hv),
        threadgroup=(32, 4, 1),
        output_shapes=[(B, T, Hv, Dv), state.shape],
        output_dtypes=[q.dtype, state.dtype],
    )
    return y, new_state


def make_update(kernel: Kernel) -> Callable[..., tuple[Any, Any]]:
    """mlx-lm's ``gated_delta_update`` (same signature and gates), with ``kernel`` where
    mlx-lm would run its Metal kernel: on the GPU, ``Dk`` a multiple of 32. Elsewhere (the
    CPU stream, training, other widths) mlx-lm's ``gated_delta_ops``, as before."""
    import mlx.core as mx
    from mlx_lm.models import gated_delta as gd

    def gated_delta_update(
        q: mx.array,
        k: mx.array,
        v: mx.array,
        a: mx.array,
        b: mx.array,
        A_log: mx.array,
        dt_bias: mx.array,
        state: mx.array | None = None,
        mask: mx.array | None = None,
        *,
        use_kernel: bool = True,
        lower_bound: float | None = None,
        allow_neg_eigval: bool = False,
    ) -> tuple[mx.array, mx.array]:
        beta = mx.sigmoid(b)
        if allow_neg_eigval:
            beta = beta * 2.0
        if lower_bound is None:
            g = gd.compute_g(A_log, a, dt_bias)
        else:
            g = gd.compute_lower_bound_g(A_log, a, dt_bias, lower_bound)
        if state is None:
            B, _, Hk, Dk = q.shape
            Hv, Dv = v.shape[-2:]
            state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
        if use_kernel and kernel_applies(q, v):
            return kernel(q, k, v, g, beta, state, mask)
        return gd.gated_delta_ops(q, k, v, g, beta, state, mask)

    gated_delta_update.__doc__ = gd.gated_delta_update.__doc__
    gated_delta_update.mlx_server_kernel = kernel  # type: ignore[attr-defined]
    return gated_delta_update


def kernel_applies(q: Any, v: Any) -> bool:
    """Whether the kernel takes these shapes on this device: the GPU stream, at least one
    step, ``Dk`` a multiple of 32, whole groups of value heads per key head."""
    import mlx.core as mx

    _, T, Hk, Dk = q.shape
    Hv = v.shape[-2]
    on_gpu = mx.default_device() == mx.gpu
    return bool(on_gpu and T > 0 and Dk >= 32 and Dk % 32 == 0 and Hv % Hk == 0)


def on_cuda_gpu() -> bool:
    """Whether MLX computes on a CUDA GPU by default (never on Metal, never on the CPU)."""
    import mlx.core as mx

    cuda = getattr(mx, "cuda", None)
    if cuda is None or not cuda.is_available():
        return False
    return bool(mx.default_device().type == mx.DeviceType.gpu)


def modules_using(model: Any) -> list[ModuleType]:
    """The Python modules whose functions, among the methods of ``model``'s layers, call
    ``gated_delta_update`` by name (mlx-lm's, or one this module put there): each once, in
    the order met. A module that imports the name for layers this model lacks is left out
    (Qwen3.5's layers come from ``qwen3_5`` and ``qwen3_next``; only ``qwen3_5``'s call it)."""
    found: dict[str, ModuleType] = {}
    seen: set[type] = set()
    for layer in _layers(model):
        for klass in type(layer).__mro__:
            if klass in seen:
                continue
            seen.add(klass)
            for fn in vars(klass).values():
                if not isinstance(fn, FunctionType) or not _names(fn.__code__, NAME):
                    continue
                mod = sys.modules.get(fn.__module__)
                current = getattr(mod, NAME, None)
                if mod is None or mod.__name__ in found or current is None:
                    continue
                if _is_mlx_lm(current) or hasattr(current, "mlx_server_kernel"):
                    found[mod.__name__] = mod
    return list(found.values())


def _names(code: CodeType, name: str) -> bool:
    """Whether ``code`` (or a function nested in it) reads the global ``name``."""
    if name in code.co_names:
        return True
    return any(isinstance(c, CodeType) and _names(c, name) for c in code.co_consts)


def _layers(model: Any) -> Iterable[Any]:
    yield model
    modules = getattr(model, "modules", None)
    if callable(modules):
        yield from modules()


def _is_mlx_lm(fn: Any) -> bool:
    from mlx_lm.models import gated_delta as gd

    return fn is gd.gated_delta_update


def patch(modules: Iterable[ModuleType], update: Callable[..., Any]) -> list[str]:
    """Set ``gated_delta_update`` to ``update`` in each module; returns their names. Every
    model of these modules in this process uses it from then on."""
    names = []
    for mod in modules:
        setattr(mod, NAME, update)
        names.append(mod.__name__)
    return names


def self_check(kernel: Kernel) -> str | None:
    """Compare ``kernel`` with ``reference`` (mlx-lm's ``gated_delta_ops`` in NumPy: no GPU
    builds but the kernel's own) on random inputs: one step and several, with and without a
    mask, a scalar and a per-element gate. Returns what differs (None: all agree)."""
    import mlx.core as mx
    import numpy as np

    # bfloat16 as the models run; three kernel builds, of which Qwen3.5 uses the first two.
    cases = [  # (dtype, T, masked, vector gate)
        (mx.bfloat16, 1, False, False),
        (mx.bfloat16, 7, False, False),
        (mx.bfloat16, 1, True, False),
        (mx.bfloat16, 7, True, False),
        (mx.bfloat16, 1, True, True),
        (mx.bfloat16, 6, True, True),
    ]
    keys = mx.random.split(mx.random.key(7), len(cases))
    for i, (dtype, T, masked, vector_gate) in enumerate(cases):
        args = _inputs(keys[i], dtype, T, masked, vector_gate)
        what = f"dtype {dtype}, T={T}, mask {masked}, per-element gate {vector_gate}"
        try:
            y, st = kernel(*args)
            mx.eval(y, st)
        except Exception as e:  # a kernel that fails to build or run is a failed check
            return f"{type(e).__name__}: {e}"
        if y.shape != args[2].shape or st.shape != args[5].shape:
            return f"shapes differ ({what}): {y.shape}, {st.shape}"
        if y.dtype != dtype or st.dtype != args[5].dtype:
            return f"dtypes differ ({what}): {y.dtype}, {st.dtype}"
        y_ref, st_ref = reference(*args)
        y_got = np.array(y.astype(mx.float32))
        if args[6] is not None:  # a masked step's output is padding: ops and kernels differ
            keep = np.array(args[6])[:, :, None, None]
            y_got, y_ref = np.where(keep, y_got, 0), np.where(keep, y_ref, 0)
        # Relative to the largest value: bfloat16 outputs may round one unit (2^-8) apart;
        # the float32 state only differs in the order of the sums.
        dy = _rel_diff(y_got, y_ref)
        ds = _rel_diff(np.array(st.astype(mx.float32)), st_ref)
        if not (dy <= (8e-3 if dtype == mx.bfloat16 else 1e-4) and ds <= 1e-4):
            return f"outputs differ ({what}): relative max |dy| {dy:.3g}, |dstate| {ds:.3g}"
    return None


def reference(q, k, v, g, beta, state, mask=None):  # type: ignore[no-untyped-def]
    """mlx-lm's ``gated_delta_ops`` in NumPy (float64), for the self-check: ``y`` and the
    final state as float64 arrays. A masked step keeps the state and still has an output."""
    import mlx.core as mx
    import numpy as np

    def f64(x: Any) -> Any:
        return np.array(x.astype(mx.float32)).astype(np.float64)

    q, k, v, g, beta, s = f64(q), f64(k), f64(v), f64(g), f64(beta), f64(state)
    keep = None if mask is None else np.array(mask).astype(bool)
    repeat = v.shape[2] // q.shape[2]
    q, k = np.repeat(q, repeat, axis=2), np.repeat(k, repeat, axis=2)
    ys = []
    for t in range(q.shape[1]):
        decay = g[:, t, :, None, None] if g.ndim == 3 else g[:, t, :, None, :]
        new = s * decay
        kt = k[:, t, :, None, :]
        delta = (v[:, t] - (new * kt).sum(-1)) * beta[:, t, :, None]
        new = new + kt * delta[..., None]
        ys.append((new * q[:, t, :, None, :]).sum(-1))
        s = new if keep is None else np.where(keep[:, t, None, None, None], new, s)
    return np.stack(ys, axis=1), s


def _rel_diff(a: Any, b: Any) -> float:
    """max |a - b| over max |b|."""
    import numpy as np

    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-6))


def _inputs(key: Any, dtype: Any, T: int, masked: bool, vector_gate: bool) -> tuple[Any, ...]:
    """Inputs shaped like a model's: q and k unit rows (q scaled by Dk^-1/2), two value heads
    per key head, gates in (0.5, 1), a left-padding mask that covers row 0's first step."""
    import mlx.core as mx

    # Dk as in the models (128), so that the model's first call reuses these builds.
    B, Hk, Hv, Dk, Dv = 2, 2, 4, 128, 32
    ks = mx.random.split(key, 7)
    q = mx.random.normal((B, T, Hk, Dk), key=ks[0])
    k = mx.random.normal((B, T, Hk, Dk), key=ks[1])
    q = q / mx.linalg.norm(q, axis=-1, keepdims=True) * Dk**-0.5
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((B, T, Hv, Dv), key=ks[2])
    g_shape = (B, T, Hv, Dk) if vector_gate else (B, T, Hv)
    g = mx.random.uniform(0.5, 1.0, g_shape, key=ks[3])
    beta = mx.sigmoid(mx.random.normal((B, T, Hv), key=ks[4])).astype(dtype)
    state = mx.random.normal((B, Hv, Dv, Dk), key=ks[5])
    mask = None
    if masked:
        mask = mx.ones((B, T), dtype=mx.bool_)
        mask = mx.concatenate([mx.array([[False], [True]]), mask[:, 1:]], axis=1)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), g, beta, state, mask


def install(model: Any, kernel: Kernel | None = None) -> str | None:
    """On a CUDA GPU, give ``model``'s linear-attention layers the CUDA kernel: patch the
    mlx-lm modules that call ``gated_delta_update`` once ``self_check`` passes. Returns a
    line for the log, or None where nothing changed (not a CUDA GPU, no such layer, or a
    failed check, which logs a warning and leaves mlx-lm's path). ``kernel``: the function
    to check and install (tests); default this module's ``gated_delta_kernel``."""
    if not on_cuda_gpu():
        return None
    modules = modules_using(model)
    if not modules:
        return None
    kernel = kernel or gated_delta_kernel
    if all(getattr(getattr(m, NAME), "mlx_server_kernel", None) is kernel for m in modules):
        return _describe([m.__name__ for m in modules])
    problem = self_check(kernel)
    if problem is not None:
        log(f"Warning: the CUDA gated-delta kernel failed its self-check ({problem}); "
            "linear attention keeps mlx-lm's step-by-step path")  # fmt: skip
        return None
    return _describe(patch(modules, make_update(kernel)))


def _describe(names: list[str]) -> str:
    return f"the CUDA gated-delta kernel, self-checked, in {', '.join(names)}"
