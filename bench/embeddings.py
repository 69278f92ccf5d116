"""Embedding throughput: our engine (MLX) against sentence-transformers (torch), one run.

    python bench/embeddings.py [--model models/all-minilm-l6-v2] [--repeats 5]
        [--torch-device auto|cpu|cuda|mps] [--workloads "1 short,16 short,256 short,32 long"]

Measures texts per second for batches of 1, 16 and 256 short texts and for 32 long ones
(at least 256 tokens, cut at the model's maximum by both sides), ours through the embedding
service (tokenizer, engine thread, padded length-grouped batches, pooling) and
sentence-transformers' ``encode`` with the same batch size, on the device each framework
picks (MLX: Metal, CUDA or CPU; torch: CUDA or MPS when present, else CPU). Prints one row
per workload with the ratio ours / sentence-transformers (above 1: we are faster) and
checks that both sides produced the same vectors. Asserts nothing about speed. On a Linux
CPU, run it after ``source scripts/openblas.sh``: MLX's bundled BLAS makes the encoder's
float32 matmuls about 20 times slower (docs/benchmarks.md); the header says which is loaded.
"""

from __future__ import annotations

import argparse
import asyncio
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


WORKLOADS = {
    "1 short": lambda: short_texts(1),
    "16 short": lambda: short_texts(16),
    "256 short": lambda: short_texts(256),
    "32 long": lambda: long_texts(32),
}


def best_rate(fn: Callable[[], Any], n_texts: int, repeats: int) -> tuple[float, Any]:
    """Texts per second: the median of ``repeats`` timed calls after one warm-up call."""
    out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return n_texts / statistics.median(times), out


def blas() -> str:
    """Which CPU BLAS this process runs MLX's matmuls with (Linux: OpenBLAS when preloaded)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown (not Linux)"
    return "OpenBLAS (preloaded)" if "libopenblas" in maps else "MLX's bundled BLAS"


class Ours:
    def __init__(self, model_dir: Path):
        import mlx.core as mx

        from mlx_server.embedding_service import EmbeddingService
        from mlx_server.engine.embedding_engine import EmbeddingEngine
        from mlx_server.engine.encoder_runner import EncoderRunner
        from mlx_server.models.embedding import load_encoder

        enc = load_encoder(model_dir, model_id="bench")
        self.engine = EmbeddingEngine(EncoderRunner(enc.model, enc.spec, enc.pad_id))
        self.engine.start()
        self.service = EmbeddingService(
            "bench", enc.tokenizer, self.engine, enc.spec, ctx_size=1 << 20
        )
        self.loop = asyncio.new_event_loop()
        self.device = str(mx.default_device())

    def encode(self, texts: list[str]) -> np.ndarray:
        done = self.service.embed(texts, truncate=True, dimensions=None)
        return np.stack(self.loop.run_until_complete(done).vectors)

    def close(self) -> None:
        self.engine.shutdown()
        self.loop.close()


class Reference:
    def __init__(self, model_dir: Path, device: str):
        import torch
        from sentence_transformers import SentenceTransformer

        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
            if device == "cpu" and torch.backends.mps.is_available():
                device = "mps"
        self.model = SentenceTransformer(str(model_dir), device=device)
        self.device = device

    def encode(self, texts: list[str], batch_size: int) -> np.ndarray:
        return np.asarray(
            self.model.encode(texts, batch_size=batch_size, normalize_embeddings=True)
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / "models" / "all-minilm-l6-v2")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--torch-device", default="auto")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated")
    args = parser.parse_args()
    chosen = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in chosen if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}")
    ours = Ours(args.model)
    ref = Reference(args.model, args.torch_device)
    batch = ours.engine.config.max_batch_size
    print(
        f"model {args.model.name}; ours on MLX {ours.device}, sentence-transformers on "
        f"torch {ref.device}; batch size {batch} on both sides; BLAS: {blas()}"
    )
    print(f"{'workload':<10} {'ours texts/s':>13} {'s-t texts/s':>12} {'ratio':>6} {'min cos':>8}")
    try:
        for name in chosen:
            texts = WORKLOADS[name]()
            ours_rate, ours_out = best_rate(
                lambda t=texts: ours.encode(t), len(texts), args.repeats
            )
            ref_rate, ref_out = best_rate(
                lambda t=texts: ref.encode(t, min(batch, len(t))), len(texts), args.repeats
            )
            cos = float((ours_out * ref_out).sum(-1).min())
            ratio = ours_rate / ref_rate
            print(f"{name:<10} {ours_rate:>13.1f} {ref_rate:>12.1f} {ratio:>6.2f} {cos:>8.5f}")
    finally:
        ours.close()


if __name__ == "__main__":
    main()
