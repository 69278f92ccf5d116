#!/usr/bin/env python3
"""The CUDA gated-delta kernel (src/mlx_server/models/gated_delta_cuda.py) against mlx-lm's
step-by-step ``gated_delta_ops`` on a CUDA GPU, at a preset's linear-attention shapes
(presets.py; default qwen35-9b: 16 key heads and 32 value heads of 128), bfloat16 inputs as the
model makes them: the largest difference of each output and the time of each, per prompt length.

  PYTHONPATH=/tmp/site:$PWD/src python3 bench/gpu/gated_delta.py --out $OUT/gated_delta.jsonl

Exits 2 with a message where MLX has no CUDA GPU. Prints a table and the self-check's verdict;
appends one JSON line per row to --out (scenario "gated_delta")."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# The project's source beside the kit (../../src) when PYTHONPATH does not name it.
sys.path.append(os.path.join(HERE, "..", "..", "src"))
sys.path.append(os.path.join(HERE, "src"))  # the kit's copy (/tmp/kit/a/src)

import mlx.core as mx  # noqa: E402
from mlx_lm.models import gated_delta as gd  # noqa: E402
from presets import config_for  # noqa: E402

from mlx_server.models import gated_delta_cuda as gdc  # noqa: E402


def shapes(preset: str) -> dict[str, int]:
    cfg = config_for(preset)
    cfg = cfg.get("text_config", cfg)
    need = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim")
    if not all(k in cfg for k in need):
        raise SystemExit(f"preset {preset!r} has no linear-attention layers")
    kinds = cfg.get("layer_types") or []
    return {
        "Hk": cfg["linear_num_key_heads"],
        "Hv": cfg["linear_num_value_heads"],
        "Dk": cfg["linear_key_head_dim"],
        "Dv": cfg["linear_value_head_dim"],
        "layers": sum(k == "linear_attention" for k in kinds) or cfg["num_hidden_layers"],
    }


def inputs(B: int, T: int, s: dict[str, int], masked: bool, seed: int) -> tuple[Any, ...]:
    """As a Qwen3.5 layer makes them: unit q and k rows (q scaled by Dk^-1/2) in bfloat16, g
    from mlx-lm's compute_g (float32), beta = sigmoid(b) in bfloat16, a float32 state."""
    Hk, Hv, Dk, Dv = s["Hk"], s["Hv"], s["Dk"], s["Dv"]
    ks = mx.random.split(mx.random.key(seed), 7)
    q = mx.random.normal((B, T, Hk, Dk), key=ks[0]).astype(mx.bfloat16)
    k = mx.random.normal((B, T, Hk, Dk), key=ks[1]).astype(mx.bfloat16)
    q, k = gd.normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
    v = mx.random.normal((B, T, Hv, Dv), key=ks[2]).astype(mx.bfloat16)
    a = mx.random.normal((B, T, Hv), key=ks[3]).astype(mx.bfloat16)
    b = mx.random.normal((B, T, Hv), key=ks[4]).astype(mx.bfloat16)
    A_log = mx.log(mx.random.uniform(1.0, 16.0, (Hv,), key=ks[5]))
    dt_bias = mx.ones((Hv,), dtype=mx.bfloat16)
    g = gd.compute_g(A_log, a, dt_bias)
    beta = mx.sigmoid(b)
    state = mx.random.normal((B, Hv, Dv, Dk), key=ks[6]) * 0.05
    mask = None
    if masked:  # left padding: row i starts i steps late
        pos = mx.arange(T)[None, :]
        mask = pos >= mx.minimum(mx.arange(B), T - 1)[:, None]
    out = (q, k, v, g, beta, state, mask)
    mx.eval([x for x in out if x is not None])
    return out


def timed(fn: Callable[..., Any], args: tuple[Any, ...], repeats: int, warmup: int) -> float:
    """Median seconds of ``fn(*args)``, evaluated, after ``warmup`` untimed runs."""
    for _ in range(warmup):
        mx.eval(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def diffs(args: tuple[Any, ...]) -> dict[str, float]:
    y, st = gdc.gated_delta_kernel(*args)
    y_ref, st_ref = gd.gated_delta_ops(*args)
    mask = args[6]
    if mask is not None:  # padding steps: the kernel writes 0, the ops path does not
        keep = mask[:, :, None, None]
        y, y_ref = mx.where(keep, y, 0), mx.where(keep, y_ref, 0)
    f32 = mx.float32
    dy = mx.max(mx.abs(y.astype(f32) - y_ref.astype(f32)))
    ds = mx.max(mx.abs(st - st_ref))
    mx.eval(dy, ds, y_ref, st_ref)
    return {
        "max_abs_dy": dy.item(),
        "max_abs_y": mx.max(mx.abs(y_ref.astype(f32))).item(),
        "max_abs_dstate": ds.item(),
        "max_abs_state": mx.max(mx.abs(st_ref)).item(),
    }


def emit(out: str | None, row: dict[str, Any]) -> None:
    row = {k: (round(v, 7) if isinstance(v, float) else v) for k, v in row.items()}
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen35-9b", help="shapes from presets.py")
    ap.add_argument("--lengths", default="1,38,100,512,2048", help="prompt lengths T")
    ap.add_argument("--batches", default="1", help="batch sizes, e.g. 1,8")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--ops-max-len", type=int, default=4096, help="longer: time the kernel only")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", help="append JSON lines here")
    args = ap.parse_args()

    if not gdc.on_cuda_gpu():
        print(f"no CUDA GPU as MLX's default device ({mx.default_device()}): nothing to measure")
        return 2
    s = shapes(args.preset)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    batches = [int(x) for x in args.batches.split(",") if x]
    print(f"mlx {mx.__version__}, {mx.default_device()}; preset {args.preset}: {s}")
    t0 = time.perf_counter()
    problem = gdc.self_check(gdc.gated_delta_kernel)
    print(f"self-check: {problem or 'passed'} ({time.perf_counter() - t0:.2f} s, with builds)")
    emit(args.out, {"scenario": "gated_delta", "label": args.label, "what": "self_check",
                    "passed": problem is None, "problem": problem})  # fmt: skip

    head = f"{'B':>3} {'T':>5} {'mask':>5} {'kernel ms':>10} {'ops ms':>10} {'x':>8} {'max|dy|':>9} {'max|y|':>7} {'max|dS|':>9}"
    print(head)
    worst = 0.0
    per_token: dict[int, float] = {}  # batch: kernel ms per step at the longest length
    for B in batches:
        for T in lengths:
            for masked in (False, True) if B > 1 else (False,):
                row = measure(B, T, masked, s, args)
                worst = max(worst, row["max_abs_dy"] / max(row["max_abs_y"], 1e-6))
                if T == max(lengths) and not masked:
                    per_token[B] = row["kernel_ms"] / T
                emit(args.out, {"scenario": "gated_delta", "label": args.label, **row})
                ops = row.get("ops_ms")
                print(
                    f"{B:>3} {T:>5} {masked!s:>5} {row['kernel_ms']:>10.3f} "
                    f"{ops if ops is None else f'{ops:.3f}':>10} "
                    f"{row.get('speedup') or 0:>8.1f} {row['max_abs_dy']:>9.2e} "
                    f"{row['max_abs_y']:>7.3f} {row['max_abs_dstate']:>9.2e}"
                )
    for B, ms in per_token.items():
        est = ms * 27000 * s["layers"] / 1000
        print(f"B={B}: {ms * 1000:.2f} us per token per layer: a 27,000-token prompt's "
              f"recurrence over {s['layers']} layers ~ {est:.2f} s")  # fmt: skip
    print(f"largest |dy| relative to max |y|: {worst:.2e}")
    return 0 if problem is None else 1


def measure(B: int, T: int, masked: bool, s: dict[str, int], args: Any) -> dict[str, Any]:
    data = inputs(B, T, s, masked, seed=B * 100_003 + T)
    row: dict[str, Any] = {"B": B, "T": T, "masked": masked, "preset": args.preset}
    row.update(diffs(data))
    row["kernel_ms"] = timed(gdc.gated_delta_kernel, data, args.repeats, args.warmup) * 1000
    if T <= args.ops_max_len:
        reps = args.repeats if T <= 512 else max(1, args.repeats // 3)
        row["ops_ms"] = timed(gd.gated_delta_ops, data, reps, 1) * 1000
        row["speedup"] = row["ops_ms"] / row["kernel_ms"]
    return row


if __name__ == "__main__":
    sys.exit(main())
