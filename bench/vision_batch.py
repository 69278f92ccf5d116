"""Vision-language models in the continuous batch, on the tests' tiny VLMs (CPU): one stream
against N = 8 requests with images at once, the one-at-a-time runner (mlx-vlm's
``generate_step``, the way before) against the batch, and a two-turn session with an image
in turn 1 (how much of turn 2 the prefix cache serves, and each turn's time to first token).
Through the engine (no HTTP); every request generates ``--tokens`` tokens (``ignore_eos``).

    PYTHONPATH=src python bench/vision_batch.py [--family idefics3|qwen2_vl] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "helpers"))

from engine_runner import request, vision_engine  # noqa: E402
from PIL import Image  # noqa: E402
from tiny_vlm import build_tiny_idefics3, build_tiny_vlm  # noqa: E402

from mlx_server.engine.core.engine import Engine, EngineConfig  # noqa: E402
from mlx_server.engine.core.handle import TokenPiece  # noqa: E402
from mlx_server.engine.runners.vision import VisionRunner  # noqa: E402
from mlx_server.models.loader import load_model  # noqa: E402
from mlx_server.models.media import MediaLimits  # noqa: E402
from mlx_server.models.prompt import render_prompt  # noqa: E402
from mlx_server.models.vision import VisionPromptBuilder  # noqa: E402
from mlx_server.types import GenerationRequest  # noqa: E402

BUILDERS = {"idefics3": build_tiny_idefics3, "qwen2_vl": build_tiny_vlm}
N = 8


def image_url(i: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (56, 56), (30 * i % 256, 255 - 20 * i % 256, 90)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class Prompts:
    def __init__(self, loaded: Any):
        self.loaded = loaded
        self.builder = VisionPromptBuilder(loaded.processor, loaded.config, MediaLimits())

    def request(self, messages: list[dict[str, Any]], tokens: int) -> GenerationRequest:
        b = self.builder
        ids, inputs = b.encode(
            render_prompt(self.loaded.tokenizer, b.template_messages(messages)), messages
        )
        key = inputs.pop("cache_tokens", None) if inputs else None
        return request(ids, tokens, vision_inputs=inputs, cache_tokens=key, ignore_eos=True)


def ask(i: int, text: str = "Describe the picture in detail.") -> dict[str, Any]:
    return {
        "role": "user",
        "content": [{"type": "image", "image": image_url(i)}, {"type": "text", "text": text}],
    }


async def timed(engine: Any, req: GenerationRequest) -> tuple[float, float, Any]:
    """(seconds to the first token, seconds to the end, Finished)."""
    t0, first = time.perf_counter(), 0.0
    async for ev in engine.submit(req):
        if isinstance(ev, TokenPiece) and not first:
            first = time.perf_counter() - t0
        elif hasattr(ev, "usage"):
            return first, time.perf_counter() - t0, ev
    raise AssertionError("no Finished")


def aggregate(engine: Any, reqs: list[GenerationRequest]) -> float:
    """Generated tokens per second of ``reqs`` submitted together."""

    async def main() -> float:
        t0 = time.perf_counter()
        done = await asyncio.gather(*(timed(engine, r) for r in reqs))
        return sum(f.usage.completion_tokens for _, _, f in done) / (time.perf_counter() - t0)

    return asyncio.run(main())


def fresh(reqs: list[GenerationRequest], tag: str) -> list[GenerationRequest]:
    return [replace(r, request_id=f"{r.request_id}-{tag}") for r in reqs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="idefics3", choices=sorted(BUILDERS))
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(str(BUILDERS[args.family](Path(tmp) / args.family)))
    prompts = Prompts(loaded)
    batch_reqs = [prompts.request([ask(i)], args.tokens) for i in range(N)]
    cfg = EngineConfig(kv_bytes_per_token=256, max_batch_size=N, prompt_cache_size=0)
    eos = sorted(loaded.tokenizer.eos_token_ids)
    serial = Engine(
        loaded.model,
        loaded.tokenizer,
        replace(cfg, max_batch_size=1, solo=False),
        runner=VisionRunner(loaded.model, eos, prefill_step_size=cfg.prefill_step_size),
    )
    batched = vision_engine(loaded.model, loaded.tokenizer, cfg)
    for e in (serial, batched):
        e.start()
        aggregate(e, fresh(batch_reqs[:2], "warm"))  # kernels, lazy imports
    one = aggregate(batched, fresh(batch_reqs[:1], "one"))
    serial_n = aggregate(serial, fresh(batch_reqs, "serial"))
    batch_n = aggregate(batched, fresh(batch_reqs, "batch"))
    serial.shutdown()
    batched.shutdown()
    print(f"{args.family}: {args.tokens} tokens per request, {batched.stats()['mode']} mode")
    print(f"  one stream            {one:8.1f} tok/s")
    print(f"  N={N} one at a time     {serial_n:8.1f} tok/s  ({serial_n / one:.2f} x one stream)")
    print(f"  N={N} batched           {batch_n:8.1f} tok/s  ({batch_n / one:.2f} x one stream)")
    session(loaded, prompts, args.tokens)


def session(loaded: Any, prompts: Prompts, tokens: int) -> None:
    engine = vision_engine(loaded.model, loaded.tokenizer, EngineConfig(kv_bytes_per_token=256))
    engine.start()
    first = [ask(N + 1, "What is in this picture? " * 8)]
    ttft1, _, f1 = asyncio.run(timed(engine, prompts.request(first, tokens)))
    second = first + [
        {"role": "assistant", "content": "A colour."},
        {"role": "user", "content": "Which one?"},
    ]
    ttft2, _, f2 = asyncio.run(timed(engine, prompts.request(second, tokens)))
    engine.shutdown()
    u1, u2 = f1.usage, f2.usage
    print(
        f"  session turn 1: {u1.prompt_tokens} prompt tokens, {u1.cached_tokens} cached, TTFT {ttft1 * 1e3:.1f} ms"
    )
    print(
        f"  session turn 2: {u2.prompt_tokens} prompt tokens, {u2.cached_tokens} cached "
        f"({u2.cached_tokens / u2.prompt_tokens:.0%}), TTFT {ttft2 * 1e3:.1f} ms "
        f"({ttft2 / ttft1:.2f} x turn 1)"
    )


if __name__ == "__main__":
    main()
