"""Embedding throughput: our engine (MLX) against sentence-transformers (torch), one run.

    python bench/embeddings.py [--model models/all-minilm-l6-v2] [--repeats 5]
        [--torch-device auto|cpu|cuda|mps] [--dtype auto|float32|float16|bfloat16]
        [--workloads "1 short,16 short,256 short,32 long"] [--eager] [--json OUT --label L]

Measures texts per second for batches of 1, 16 and 256 short texts and for 32 long ones
(at least 256 tokens, cut at the model's maximum by both sides), ours through the embedding
service (tokenizer, engine thread, padded length-grouped batches, the compiled encoder step,
pooling) and sentence-transformers' ``encode`` with the same batch size, on the device each
framework picks (MLX: Metal, CUDA or CPU; torch: CUDA or MPS when present, else CPU), in the
same weights dtype on both sides. The two sides take turns within each workload (ours, then
theirs, then ours ...) so that a shared machine's load falls on both; the figure is the
median of ``--repeats`` timed calls after a warm-up call. Prints one row per workload with
the ratio ours / sentence-transformers (above 1: we are faster) and the lowest cosine
between the two sides' vectors; ``--eager`` adds our uncompiled step as a column. Asserts
nothing about speed. ``--json`` appends one JSON line per workload (scenario
``embeddings``), as the GPU kit's scripts write theirs. On a Linux CPU, run it after
``source scripts/openblas.sh``: MLX's bundled BLAS makes the encoder's float32 matmuls about
20 times slower (docs/benchmarks.md); the header says which is loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
WORDS = (REPO / "tests" / "data" / "perplexity.txt").read_text().split()
TOPICS = ["weather", "markets", "football", "cooking", "physics", "music", "travel", "code"]


def words(start: int, n: int) -> str:
    """``n`` words of the sample paragraph, from ``start``, wrapping around."""
    return " ".join(WORDS[(start + j) % len(WORDS)] for j in range(n))


def short_texts(n: int) -> list[str]:
    """Sentences of about 10 to 25 tokens, all different."""
    return [
        f"Sentence {i} is about {TOPICS[i % len(TOPICS)]}: {words(i * 7, 4 + i % 9)}"
        for i in range(n)
    ]


def long_texts(n: int, length: int = 320) -> list[str]:
    """Passages of ``length`` words (well over 256 tokens each), all different."""
    return [f"Passage {i}: {words(i * 11, length)}" for i in range(n)]


# key (for --workloads) -> (row label, texts)
WORKLOADS: dict[str, tuple[str, Callable[[], list[str]]]] = {
    "1 short": ("1 short text", lambda: short_texts(1)),
    "16 short": ("16 short texts", lambda: short_texts(16)),
    "256 short": ("256 short texts", lambda: short_texts(256)),
    "32 long": ("32 long texts (≥ 256 tokens)", lambda: long_texts(32)),
}


def blas() -> str:
    """Which CPU BLAS this process runs MLX's matmuls with (Linux: OpenBLAS when preloaded)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown (not Linux)"
    return "OpenBLAS (preloaded)" if "libopenblas" in maps else "MLX's bundled BLAS"


class Ours:
    def __init__(self, model_dir: Path, dtype: str | None, compile: bool = True):
        import mlx.core as mx

        from mlx_server.embedding_service import EmbeddingService
        from mlx_server.engine.embedding.engine import EmbeddingEngine
        from mlx_server.engine.embedding.runner import EncoderRunner
        from mlx_server.models.embedding import load_encoder

        enc = load_encoder(model_dir, model_id="bench", dtype=dtype)
        runner = EncoderRunner(enc.model, enc.spec, enc.pad_id, compile=compile)
        self.engine = EmbeddingEngine(runner)
        self.engine.start()
        self.service = EmbeddingService(
            "bench", enc.tokenizer, self.engine, enc.spec, ctx_size=1 << 20
        )
        self.loop = asyncio.new_event_loop()
        self.device = str(mx.default_device())
        dtypes = {str(v.dtype) for v in _leaves(enc.model.parameters())}
        self.dtype = ",".join(sorted(d.removeprefix("mlx.core.") for d in dtypes))
        self.tokens = 0

    def encode(self, texts: list[str]) -> np.ndarray:
        done = self.service.embed(texts, truncate=True, dimensions=None)
        result = self.loop.run_until_complete(done)
        self.tokens = result.prompt_tokens
        return np.stack(result.vectors)

    def close(self) -> None:
        self.engine.shutdown()
        self.loop.close()


def _leaves(tree: Any) -> list[Any]:
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(tree)]


class Reference:
    def __init__(self, model_dir: Path, device: str, dtype: str):
        import torch
        from sentence_transformers import SentenceTransformer

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
            if device == "cpu" and torch.backends.mps.is_available():
                device = "mps"
        self.model = SentenceTransformer(str(model_dir), device=device)
        self.model.to(getattr(torch, dtype))
        self.device = device
        self.dtype = dtype

    def encode(self, texts: list[str], batch_size: int) -> np.ndarray:
        out = self.model.encode(texts, batch_size=batch_size, normalize_embeddings=True)
        return np.asarray(out, dtype=np.float32)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def measure(sides: dict[str, Callable[[], Any]], repeats: int) -> dict[str, tuple[float, Any]]:
    """Each side's median seconds and last output: a warm-up call each, then the sides take
    turns, the order flipped every round so that neither always runs first."""
    outs = {name: fn() for name, fn in sides.items()}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for r in range(repeats):
        for name in list(sides)[:: 1 if r % 2 == 0 else -1]:
            seconds, outs[name] = timed(sides[name])
            times[name].append(seconds)
    return {name: (statistics.median(times[name]), outs[name]) for name in sides}


def min_cos(a: np.ndarray, b: np.ndarray) -> float:
    a = a / np.linalg.norm(a, axis=-1, keepdims=True)
    b = b / np.linalg.norm(b, axis=-1, keepdims=True)
    return float((a * b).sum(-1).min())


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / "models" / "all-minilm-l6-v2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--torch-device", default="auto")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="weights dtype on both sides; auto: what our loader picks (float32 on a CPU, "
        "the stored dtype on a GPU)",
    )
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated")
    parser.add_argument("--eager", action="store_true", help="also time our uncompiled step")
    parser.add_argument("--json", type=Path, help="append one JSON line per workload here")
    parser.add_argument("--label", default="embeddings", help="the JSON lines' label")
    args = parser.parse_args()
    args.chosen = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in args.chosen if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}")
    return args


def main() -> None:
    args = parse_args()
    ours = Ours(args.model, None if args.dtype == "auto" else args.dtype)
    eager = (
        Ours(args.model, None if args.dtype == "auto" else args.dtype, False)
        if args.eager
        else None
    )
    ref = Reference(args.model, args.torch_device, ours.dtype.split(",")[0])
    batch = ours.engine.config.max_batch_size
    cpu_blas = blas() if "cpu" in ours.device else "n/a (MLX on a GPU)"
    header = {
        "model": args.model.name,
        "mlx_device": ours.device,
        "torch_device": ref.device,
        "dtype": ours.dtype,
        "batch_size": batch,
        "blas": cpu_blas,
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
    }
    print(
        f"model {args.model.name}; ours on MLX {ours.device}, sentence-transformers on torch "
        f"{ref.device}; {ours.dtype} weights; batch size {batch} on both sides; BLAS: {cpu_blas}"
    )
    eager_col = f" {'eager t/s':>10}" if eager else ""
    print(
        f"{'workload':<30} {'tokens':>6} {'ours texts/s':>13}{eager_col} {'s-t texts/s':>12} "
        f"{'ratio':>6} {'min cos':>8}"
    )
    try:
        for key in args.chosen:
            label, make = WORKLOADS[key]
            texts = make()
            sides: dict[str, Callable[[], Any]] = {
                "ours": lambda t=texts: ours.encode(t),
                "st": lambda t=texts: ref.encode(t, min(batch, len(t))),
            }
            if eager is not None:
                sides["eager"] = lambda t=texts: eager.encode(t)
            got = measure(sides, args.repeats)
            rates = {name: len(texts) / seconds for name, (seconds, _) in got.items()}
            cos = min_cos(got["ours"][1], got["st"][1])
            ratio = rates["ours"] / rates["st"]
            tokens = ours.tokens / len(texts)
            eager_cell = f" {rates['eager']:>10.1f}" if eager else ""
            print(
                f"{label:<30} {tokens:>6.0f} {rates['ours']:>13.1f}{eager_cell} "
                f"{rates['st']:>12.1f} {ratio:>6.2f} {cos:>8.5f}",
                flush=True,
            )
            if args.json:
                row = {
                    "scenario": "embeddings",
                    "label": args.label,
                    "workload": label,
                    "texts": len(texts),
                    "tokens_per_text": round(tokens, 1),
                    "ours_texts_s": round(rates["ours"], 2),
                    "st_texts_s": round(rates["st"], 2),
                    "ratio": round(ratio, 3),
                    "min_cos": round(cos, 6),
                    "repeats": args.repeats,
                    **({"eager_texts_s": round(rates["eager"], 2)} if eager else {}),
                    **header,
                    "ts": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                }
                with open(args.json, "a") as f:
                    f.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n")
    finally:
        ours.close()
        if eager is not None:
            eager.close()


if __name__ == "__main__":
    main()
    # Skip the interpreter's teardown: with MLX and torch in one process, the native
    # libraries' exit handlers have aborted after every figure was written ("terminate
    # called without an active exception", one run in several on 2 cores).
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
