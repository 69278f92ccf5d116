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


class Timed:
    """Wraps a logits processor and adds up the wall time spent inside it."""

    def __init__(self, processor: Any):
        self.processor = processor
        self.seconds = 0.0

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        start = time.perf_counter()
        out = self.processor(tokens, logits)
        self.seconds += time.perf_counter() - start
        return out


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


def one_round(model, tokenizer, compiler, prompt, args) -> dict[str, Any]:
    spec = ConstraintSpec.json_schema(SCHEMA)
    timed = [Timed(compiler.processor(spec)) for _ in range(args.batch)]
    steps_c, secs_c, outs = decode(
        model, tokenizer, prompt, batch=args.batch, max_tokens=args.max_tokens, processors=timed
    )
    n = max(len(o) for o in outs)
    steps_u, secs_u, _ = decode(
        model, tokenizer, prompt, batch=args.batch, max_tokens=n, stop=False
    )
    valid = [_parses(tokenizer, o) for o in outs]
    return {
        "generated_tokens": n,
        "constrained_tps": args.batch * steps_c / secs_c,
        "unconstrained_tps": args.batch * steps_u / secs_u,
        "processor_ms_per_call": 1000 * sum(t.seconds for t in timed) / (args.batch * max(n, 1)),
        "valid_json": all(valid),
        "sample": tokenizer.decode([t for t in outs[0] if t not in tokenizer.eos_token_ids])[:160],
    }


def _parses(tokenizer, tokens: list[int]) -> bool:
    try:
        json.loads(tokenizer.decode([t for t in tokens if t not in tokenizer.eos_token_ids]))
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
    print(json.dumps({"model": what, "vocab": len(tokenizer), "setup_ms": round(setup_ms, 1)}))
    prompt = prompt_tokens(tokenizer)
    decode(model, tokenizer, prompt, batch=args.batch, max_tokens=8)  # warm up
    ratios = []
    for i in range(args.rounds):
        result = one_round(model, tokenizer, compiler, prompt, args)
        result["ratio"] = result["constrained_tps"] / result["unconstrained_tps"]
        ratios.append(result["ratio"])
        print(json.dumps({"round": i, "batch": args.batch, **_rounded(result)}))
    print(
        json.dumps(
            {"summary": what, "batch": args.batch, "median_ratio": statistics.median(ratios)}
        )
    )


def _rounded(result: dict[str, Any]) -> dict[str, Any]:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}


if __name__ == "__main__":
    main()
