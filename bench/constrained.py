"""Decode speed with and without a JSON-schema constraint, measured side by side.

Each round first generates under the constraint, then generates exactly as many tokens
without it (end-of-sequence disabled), so both decode the same number of steps over the
same context lengths. Rounds alternate to spread out noise from other work on the host.
Prints one JSON line per run and a summary line with the median ratio.

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

from mlx_server.engine.constraints import ConstraintCompiler, ConstraintSpec

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
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        from tests.test_constraints import make_hf_tokenizer, make_model

        hf = make_hf_tokenizer()
        return make_model(len(hf)), TokenizerWrapper(hf), "tiny random-weight llama"
    from mlx_lm import load as mlx_load

    candidates = [args.model] if args.model else list(DEFAULT_MODELS)
    for path in candidates:
        if Path(path).is_dir():
            if args.random_weights:
                return *random_weights(Path(path)), f"{path} (random weights)"
            model, tokenizer = mlx_load(path)
            return model, tokenizer, path
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


def decode(model, tokenizer, prompt, *, batch, max_tokens, processors=None, stop=True):
    """Generate for ``batch`` copies of the prompt; returns (steps, seconds, outputs)."""
    mx.random.seed(0)
    gen = BatchGenerator(
        model,
        stop_tokens=[[t] for t in tokenizer.eos_token_ids] if stop else None,
        sampler=make_sampler(temp=0.0),
    )
    gen.insert(
        [prompt] * batch,
        max_tokens=[max_tokens] * batch,
        logits_processors=[[p] for p in processors] if processors else None,
    )
    outputs: dict[int, list[int]] = {}
    finished = 0
    first = last = 0.0
    steps = 0
    while finished < batch:
        responses = gen.next_generated()
        now = time.perf_counter()
        if not first:
            first = now  # the first token comes after prefill; time the decode from here
        else:
            steps += 1
        last = now
        for r in responses:
            outputs.setdefault(r.uid, []).append(r.token)
            finished += r.finish_reason is not None
    gen.close()
    return steps, last - first, list(outputs.values())


def one_round(model, tokenizer, compiler, prompt, args) -> tuple[dict[str, Any], list[int]]:
    spec = ConstraintSpec.json_schema(SCHEMA)
    processors = [compiler.processor(spec) for _ in range(args.batch)]
    steps_c, secs_c, outs = decode(
        model,
        tokenizer,
        prompt,
        batch=args.batch,
        max_tokens=args.max_tokens,
        processors=processors,
    )
    n = max(len(o) for o in outs)
    steps_u, secs_u, _ = decode(
        model, tokenizer, prompt, batch=args.batch, max_tokens=n, stop=False
    )
    result = {
        "generated_tokens": n,
        "constrained_tps": args.batch * steps_c / secs_c,
        "unconstrained_tps": args.batch * steps_u / secs_u,
        "valid_json": all(_parses(tokenizer, o) for o in outs),
        "sample": _text(tokenizer, outs[0])[:120],
    }
    return result, outs[0]


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
    parser.add_argument("--rounds", type=int, default=5)
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
    decode(model, tokenizer, prompt, batch=args.batch, max_tokens=8)  # warm up
    ratios = []
    for i in range(args.rounds):
        result, tokens = one_round(model, tokenizer, compiler, prompt, args)
        result["ratio"] = result["constrained_tps"] / result["unconstrained_tps"]
        ratios.append(result["ratio"])
        emit({"round": i, "batch": args.batch, **result})
    vocab = model(mx.array([prompt[:1]])).shape[-1]
    emit({"replay_tokens": len(tokens), **replay(compiler, tokens, vocab)})
    emit({"summary": what, "batch": args.batch, "median_ratio": statistics.median(ratios)})


def emit(record: dict[str, Any]) -> None:
    rounded = {k: round(v, 3) if isinstance(v, float) else v for k, v in record.items()}
    print(json.dumps(rounded), flush=True)


if __name__ == "__main__":
    main()
