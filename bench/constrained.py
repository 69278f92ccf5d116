"""Decode speed with and without a JSON-schema constraint, measured side by side.

Each round decodes the same prompt with and without the constraint in alternating chunks
of a few steps (the unconstrained run ignores end-of-sequence), so both cover the same
context lengths and slow drifts in the host's load cancel out within each pair of chunks.
Prints one JSON line per round, the processor's own cost replayed without the model, and
a summary with the median ratio (constrained / unconstrained tokens per second).

    PYTHONPATH=src .venv/bin/python bench/constrained.py [--model DIR] [--rounds 5] [--batch 1]
    PYTHONPATH=src .venv/bin/python bench/constrained.py --tiny   # random-weight test model
    PYTHONPATH=src .venv/bin/python bench/constrained.py --random-weights  # same shapes, no weights
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import make_sampler

from mlx_server.engine.grammar.constraints import ConstraintCompiler, ConstraintSpec

DEFAULT_MODELS = ("models/smollm2-135m-instruct-f32", "models/smollm2-135m-instruct")

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"enum": ["France", "Norway", "Japan", "Brazil", "Other"]},
        "population": {"type": "integer", "minimum": 0},
        "founded": {"type": "string", "format": "date"},
        "landmarks": {
            "type": "array",
            "minItems": 3,
            "maxItems": 6,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 60},
                    "kind": {"enum": ["museum", "park", "monument", "building", "other"]},
                    "visitors_per_year": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                    "free": {"type": "boolean"},
                },
                "required": ["name", "kind", "visitors_per_year", "free"],
                "additionalProperties": False,
            },
        },
        "summary": {"type": "string", "maxLength": 200},
    },
    "required": ["city", "country", "population", "founded", "landmarks", "summary"],
    "additionalProperties": False,
}
QUESTION = (
    "Describe Paris as JSON with the keys city, country, population, founded (a date), "
    "landmarks (name, kind, visitors_per_year, free) and summary."
)


def load(args: argparse.Namespace) -> tuple[Any, Any, str]:
    """The model, its tokenizer wrapper and a description of what was loaded."""
    if args.tiny:
        repo = Path(__file__).resolve().parents[1]
        sys.path[:0] = [str(repo), str(repo / "tests" / "helpers")]
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        from tests.engine.test_constraints import make_hf_tokenizer, make_model

        hf = make_hf_tokenizer()
        return make_model(len(hf)), TokenizerWrapper(hf), "tiny random-weight llama"
    from mlx_lm import load as mlx_load

    candidates = [args.model] if args.model else list(DEFAULT_MODELS)
    for path in candidates:
        if Path(path).is_dir():
            if args.random_weights:
                model, tokenizer = random_weights(Path(path))
                return model, tokenizer, f"{path} (random weights)"
            loaded = mlx_load(path)
            return loaded[0], loaded[1], path
    raise SystemExit(f"no model directory among {candidates}; pass --model or --tiny")


def random_weights(path: Path) -> tuple[Any, Any]:
    """The model of ``path``'s config with random weights, and its real tokenizer."""
    from mlx_lm.utils import _get_classes, load_config, load_tokenizer

    config = load_config(path)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    return model, load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))


def prompt_tokens(tokenizer: Any) -> list[int]:
    if getattr(tokenizer, "has_chat_template", False):
        messages = [{"role": "user", "content": QUESTION}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return list(tokenizer.encode(QUESTION))


def generator(model, tokenizer, prompt, *, batch, processors=None):
    """A BatchGenerator decoding ``batch`` copies of the prompt; constrained ones stop at
    end-of-sequence, unconstrained ones run on (so both decode the same steps)."""
    gen = BatchGenerator(
        model,
        stop_tokens=[[t] for t in tokenizer.eos_token_ids] if processors else None,
        sampler=make_sampler(temp=0.0),
    )
    gen.insert(
        [prompt] * batch,
        max_tokens=[4096] * batch,
        logits_processors=[[p] for p in processors] if processors else None,
    )
    return gen


def timed_steps(gen, steps: int, outputs: dict[int, list[int]]) -> tuple[float, bool]:
    """Advance ``gen`` by ``steps`` decode steps; (seconds, whether any sequence ended)."""
    start = time.perf_counter()
    ended = False
    for _ in range(steps):
        for r in gen.next_generated():
            outputs.setdefault(r.uid, []).append(r.token)
            ended = ended or r.finish_reason is not None
    return time.perf_counter() - start, ended


def one_round(model, tokenizer, compiler, prompt, args) -> tuple[dict[str, Any], list[int]]:
    """Decode with and without the constraint in alternating chunks of ``args.chunk``
    steps; each adjacent pair of chunks gives one speed ratio."""
    spec = ConstraintSpec.json_schema(SCHEMA)
    processors = [compiler.processor(spec) for _ in range(args.batch)]
    constrained = generator(model, tokenizer, prompt, batch=args.batch, processors=processors)
    free = generator(model, tokenizer, prompt, batch=args.batch)
    outs: dict[int, list[int]] = {}
    ignored: dict[int, list[int]] = {}
    timed_steps(constrained, 2, outs)  # prefill and first tokens, untimed
    timed_steps(free, 2, ignored)
    ratios, secs_c, secs_u = [], 0.0, 0.0
    while True:
        c, ended = timed_steps(constrained, args.chunk, outs)
        if ended or len(outs[min(outs)]) >= args.max_tokens:
            break
        u, _ = timed_steps(free, args.chunk, ignored)
        ratios.append(u / c)
        secs_c, secs_u = secs_c + c, secs_u + u
    constrained.close()
    free.close()
    steps = args.chunk * len(ratios)
    first = outs[min(outs)]
    result = {
        "generated_tokens": len(first),
        "timed_steps": steps,
        "constrained_tps": args.batch * steps / secs_c,
        "unconstrained_tps": args.batch * steps / secs_u,
        "median_chunk_ratio": statistics.median(ratios),
        "valid_json": all(_parses(tokenizer, o) for o in outs.values()),
        "sample": _text(tokenizer, first)[:120],
    }
    return result, first


def replay(compiler, tokens: list[int], vocab: int) -> dict[str, float]:
    """The processor's own cost per token, without the model: replay ``tokens`` through
    fresh processors with constant logits (the first pass also builds lexer states)."""
    logits = mx.zeros((1, vocab))
    passes = []
    for _ in range(3):
        processor = compiler.processor(ConstraintSpec.json_schema(SCHEMA))
        context = [0]
        times = []
        for token in tokens:
            start = time.perf_counter()
            mx.eval(processor(mx.array(context), logits))
            times.append(time.perf_counter() - start)
            context.append(token)
        passes.append(times)
    return {
        "first_pass_ms_per_token": 1000 * statistics.mean(passes[0]),
        "ms_per_token": 1000 * statistics.mean(passes[-1]),
        "max_ms": 1000 * max(passes[-1]),
    }


def _text(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode([t for t in tokens if t not in tokenizer.eos_token_ids])


def _parses(tokenizer, tokens: list[int]) -> bool:
    try:
        json.loads(_text(tokenizer, tokens))
    except ValueError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help=f"model directory (default: first of {DEFAULT_MODELS})")
    parser.add_argument("--tiny", action="store_true", help="use the random-weight test model")
    parser.add_argument(
        "--random-weights", action="store_true", help="model config and tokenizer only"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=4, help="decode steps per timed chunk")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=400)
    args = parser.parse_args()

    model, tokenizer, what = load(args)
    start = time.perf_counter()
    compiler = ConstraintCompiler(tokenizer)
    compiler.compile(ConstraintSpec.json_schema(SCHEMA))
    setup_ms = 1000 * (time.perf_counter() - start)
    emit({"model": what, "vocab": len(tokenizer), "setup_ms": setup_ms})
    prompt = prompt_tokens(tokenizer)
    ratios = []
    for i in range(args.rounds):
        result, tokens = one_round(model, tokenizer, compiler, prompt, args)
        ratios.append(result["median_chunk_ratio"])
        emit({"round": i, "batch": args.batch, **result})
    vocab = model(mx.array([prompt[:1]])).shape[-1]
    emit({"replay_tokens": len(tokens), **replay(compiler, tokens, vocab)})
    emit({"summary": what, "batch": args.batch, "median_ratio": statistics.median(ratios)})


def emit(record: dict[str, Any]) -> None:
    rounded = {k: round(v, 3) if isinstance(v, float) else v for k, v in record.items()}
    print(json.dumps(rounded), flush=True)


if __name__ == "__main__":
    main()
