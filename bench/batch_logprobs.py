"""Log-probabilities in the batch: N streams through the engine (no HTTP) with each token's
top-k log-probabilities asked, against the same streams without, in interleaved rounds.

The engine is the server's text engine (``runners.assembly.text_runner``), greedy, EOS ignored,
its prefix cache off (every round's prompts are new). Throughput counts every stream's tokens
over the burst's wall time. Prints one line per round and the median ratio (asked / not).
Run it with another source tree on ``PYTHONPATH`` to compare builds.

    source scripts/openblas.sh
    PYTHONPATH=src .venv/bin/python bench/batch_logprobs.py [--model DIR | --random 4x256]
        [--streams 8] [--tokens 128] [--top 5] [--rounds 4]

``--random LxH`` replaces the model with a random-weight Llama of L layers and hidden size H
over ``--model``'s tokenizer (a small model: the per-row work is a larger share of a step,
as on a GPU).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def random_llama(tokenizer_dir: str, shape: str) -> tuple[Any, Any]:
    import mlx.core as mx
    from mlx_lm.models import llama
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    layers, hidden = (int(x) for x in shape.split("x"))
    tok = load_tokenizer(Path(tokenizer_dir))
    args = llama.ModelArgs.from_dict(
        {
            "model_type": "llama",
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "intermediate_size": 2 * hidden,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5,
            "vocab_size": tok.vocab_size,
            "tie_word_embeddings": True,
        }
    )
    mx.random.seed(0)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model, tok


async def burst(engine: Any, tok: Any, n: int, tokens: int, top: int | None, tag: str) -> float:
    from mlx_server.engine.core.handle import TokenPiece
    from mlx_server.types import GenerationRequest, SamplingParams

    loop = asyncio.get_running_loop()

    async def one(i: int) -> float:
        msgs = [{"role": "user", "content": f"[{tag} {i}] Tell me about lighthouses."}]
        prompt = list(tok.apply_chat_template(msgs, add_generation_prompt=True))
        req = GenerationRequest(
            request_id=uuid.uuid4().hex,
            prompt_tokens=prompt,
            max_tokens=tokens,
            sampling=SamplingParams(temperature=0.0),
            ignore_eos=True,
            logprobs=top is not None,
            top_logprobs=top or 0,
        )
        async for ev in engine.submit(req, loop):
            if isinstance(ev, TokenPiece):
                pass
        return time.perf_counter()

    t0 = time.perf_counter()
    ends = await asyncio.gather(*[one(i) for i in range(n)])
    return n * tokens / (max(ends) - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct-f32"))
    p.add_argument("--random", default="", help="LxH: a random Llama over --model's tokenizer")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--rounds", type=int, default=4)
    a = p.parse_args()

    from mlx_lm import load

    from mlx_server.engine.core.engine import Engine, EngineConfig
    from mlx_server.engine.runners.assembly import text_runner

    model, tok = random_llama(a.model, a.random) if a.random else load(a.model)[:2]
    cfg = EngineConfig(max_batch_size=a.streams, kv_budget_bytes=8 << 30, prompt_cache_size=0)
    engine = Engine(model, tok, cfg, runner=text_runner(model, tok, cfg))
    engine.start()
    engine.wait_ready()

    async def run() -> None:
        await burst(engine, tok, a.streams, 8, None, "warm")
        await burst(engine, tok, a.streams, 8, a.top, "warm top")
        rates: dict[str, list[float]] = {"none": [], "top": []}
        for r in range(a.rounds):  # each round turns the order
            order = ["none", "top"] if r % 2 == 0 else ["top", "none"]
            for mode in order:
                top = a.top if mode == "top" else None
                rates[mode].append(
                    await burst(engine, tok, a.streams, a.tokens, top, f"{mode} {r}")
                )
            print(
                f"round {r}: none {rates['none'][-1]:.0f} tok/s, top {a.top} {rates['top'][-1]:.0f}"
            )
        ratio = statistics.median(rates["top"]) / statistics.median(rates["none"])
        print(f"{a.streams} streams, top {a.top} / none: {ratio:.3f}", flush=True)

    try:
        asyncio.run(run())
    finally:
        engine.shutdown(timeout=10)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
