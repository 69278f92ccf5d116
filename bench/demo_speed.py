"""Speed of the demo model on this machine: import, load, prompt and decode tokens/s.

Compares the quantized import (4-bit layers, 8-bit embedding) with dequantized float32 and
bfloat16 imports, each with MLX's bundled BLAS and with OpenBLAS preloaded (`LD_PRELOAD`,
which only takes effect at process start, so every configuration runs in its own process).

    python bench/demo_speed.py [--prompt-tokens 128] [--decode-tokens 64] [--blas PATH]
        [--variants quantized,float32,bfloat16,quantized-f16-scales]

Prints one row per configuration and ratios against the first one; asserts nothing.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OPENBLAS_GLOBS = [
    "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/libopenblas.so.0",
]
# variant -> import options
VARIANTS = {
    "quantized": {"dtype": None},
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "quantized-f16-scales": {"dtype": None, "float_dtype": "float16"},
}
PARAGRAPH = (REPO / "tests" / "data" / "perplexity.txt").read_text()


def measure(variant: str, prompt_tokens: int, decode_tokens: int) -> dict[str, float]:
    """Import, load and generate with one variant in this process."""
    import mlx.core as mx
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    from mlx_server.models.demo import ensure_demo_gguf
    from mlx_server.models.gguf.importer import import_gguf

    gguf = ensure_demo_gguf(REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        import_gguf(gguf, Path(tmp), progress=False, **VARIANTS[variant])
        imported = time.perf_counter()
        model, tokenizer = load(tmp)
        mx.eval(model.parameters())
        loaded = time.perf_counter()
    ids = (tokenizer.encode(PARAGRAPH) * (prompt_tokens // 50 + 1))[:prompt_tokens]
    greedy = make_sampler(temp=0.0)
    for _ in stream_generate(model, tokenizer, ids[:8], max_tokens=2, sampler=greedy):
        pass  # warm up
    # The last response carries the prompt and generation speeds of the whole run.
    (last,) = deque(
        stream_generate(model, tokenizer, ids, max_tokens=decode_tokens, sampler=greedy), maxlen=1
    )
    return {
        "import_s": imported - start,
        "load_s": loaded - imported,
        "prompt_tps": last.prompt_tps,
        "decode_tps": last.generation_tps,
        "decoded": last.generation_tokens,
    }


def run_worker(variant: str, blas: str | None, args: argparse.Namespace) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    env.pop("LD_PRELOAD", None)
    if blas:
        env["LD_PRELOAD"] = blas
    command = [sys.executable, __file__, "--worker", variant]
    command += [
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--decode-tokens",
        str(args.decode_tokens),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def find_openblas(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    return next((hit for pattern in OPENBLAS_GLOBS for hit in sorted(glob.glob(pattern))), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--blas", help="OpenBLAS .so to preload (default: Debian's, if present)")
    parser.add_argument("--variants", default="quantized,float32,bfloat16")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker, args.prompt_tokens, args.decode_tokens)))
        return 0
    openblas = find_openblas(args.blas)
    blas_options: list[str | None] = [None] + ([openblas] if openblas else [])
    if not openblas:
        print("OpenBLAS not found (apt-get install libopenblas0-pthread); bundled BLAS only")
    print(f"prompt {args.prompt_tokens} tokens, decode {args.decode_tokens} tokens, greedy")
    header = f"{'variant':22} {'BLAS':9} {'import s':>9} {'load s':>7} {'prompt tok/s':>13} {'decode tok/s':>13}"
    print(header)
    rows = []
    for variant in args.variants.split(","):
        for blas in blas_options:
            result = run_worker(variant, blas, args)
            rows.append((variant, blas, result))
            print(
                f"{variant:22} {'OpenBLAS' if blas else 'bundled':9} {result['import_s']:9.2f} "
                f"{result['load_s']:7.2f} {result['prompt_tps']:13.1f} {result['decode_tps']:13.1f}",
                flush=True,
            )
    base = rows[0][2]
    print(f"\nratios against {rows[0][0]} with bundled BLAS (prompt, decode):")
    for variant, blas, result in rows[1:]:
        prompt = result["prompt_tps"] / base["prompt_tps"]
        decode = result["decode_tps"] / base["decode_tps"]
        print(
            f"  {variant:22} {'OpenBLAS' if blas else 'bundled':9} x{prompt:5.2f}  x{decode:5.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
