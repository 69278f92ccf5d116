"""Speculative decoding against plain decoding, side by side in one run.

Workloads (greedy): a code edit (a 60-line source file in the prompt, asked back with one
change: prompt lookup's best case) and non-repetitive prose (its worst). Each runs on the
lone-request runner without speculation (``SoloSequence``) and with it
(``SpeculativeSequence``: prompt lookup, then the model drafting for itself), and the
output of each run is checked to be the same tokens. Then the step-cost model: a forward
pass over k + 1 tokens against a one-token decode step, which is what a draft of k costs.

    source scripts/openblas.sh
    python bench/speculative.py [--model models/smollm2-135m-instruct-f32] [--tokens 200]
        [--num-draft-tokens 4,8] [--repeat 2]

Prints decode tokens/s, acceptance and ratios; asserts nothing. The machine may be shared:
run it more than once and read the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

print = functools.partial(print, flush=True)  # noqa: A001 (progress while it runs)
REPO = Path(__file__).resolve().parents[1]
SOURCE = (REPO / "bench" / "data" / "code_edit_source.py.txt").read_text()
CODE_EDIT = (
    "Here is a Python file:\n```python\n"
    + SOURCE
    + "```\nRename the class DraftLength to DraftCount and return the whole file, "
    "unchanged otherwise. Output only the code."
)
PROSE = (
    "Write an essay about the history of lighthouses: the first ones in antiquity, how "
    "their lamps and lenses changed, the lives of their keepers, and why few are staffed "
    "today."
)


def greedy(x: mx.array) -> mx.array:
    return mx.argmax(x, axis=-1)


def decode(model: Any, prompt: list[int], n: int, drafter: Any, k: int) -> dict[str, Any]:
    """Decode ``n`` tokens (EOS ignored); tokens/s counted from the first token."""
    from mlx_server.engine.runner import Insert
    from mlx_server.engine.solo import SoloSequence
    from mlx_server.engine.speculative.sequence import SpeculativeSequence
    from mlx_server.types import GenerationRequest

    common: dict[str, Any] = dict(max_tokens=n, eos=[], prefill_step_size=512)
    if drafter is None:
        job = Insert(1, GenerationRequest("bench", prompt, n), prompt, 0, None, greedy)
        seq: Any = SoloSequence(model, job, [], 512)
    else:
        seq = SpeculativeSequence(
            model, 1, prompt, 0, None, sampler=greedy, greedy=True, drafter=drafter,
            num_draft_tokens=k, **common,
        )  # fmt: skip
    tokens: list[int] = []
    t_first = 0.0
    while True:
        _, responses = seq.next()
        for r in responses:
            if not tokens:
                t_first = time.perf_counter()
            tokens.append(r.token)
        if responses and responses[-1].finish_reason is not None:
            break
    secs = time.perf_counter() - t_first
    drafted = getattr(seq, "draft_n", 0)
    accepted = getattr(seq, "draft_accepted", 0)
    return {
        "tokens": tokens,
        "tps": (len(tokens) - 1) / secs,
        "drafted": drafted,
        "accepted": accepted,
    }


def step_costs(model: Any, prompt: list[int], ks: list[int], reps: int = 8) -> dict[int, float]:
    """Seconds of one forward pass over k + 1 tokens after the prompt, for each k (k = 0:
    a decode step)."""
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array(prompt)[None], cache=cache)
    mx.eval([c.state for c in cache])
    out: dict[int, float] = {}
    for k in [0, *ks]:
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            mx.eval(model(mx.array(prompt[-(k + 1) :])[None], cache=cache))
            times.append(time.perf_counter() - t)
            trim_prompt_cache(cache, k + 1)
        out[k] = sorted(times)[len(times) // 2]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO / "models" / "smollm2-135m-instruct-f32"))
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--num-draft-tokens", default="4,8")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()

    from mlx_lm import load

    from mlx_server.engine.speculative.drafters import DraftModel, PromptLookup

    model, tokenizer = load(args.model)
    ks = [int(k) for k in args.num_draft_tokens.split(",")]

    def chat(text: str) -> list[int]:
        msgs = [{"role": "user", "content": text}]
        return list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True))

    decode(model, chat("Hi"), 8, None, 0)  # warm-up
    for name, text in (("code edit", CODE_EDIT), ("prose", PROSE)):
        prompt = chat(text)
        for rep in range(args.repeat):
            base = decode(model, prompt, args.tokens, None, 0)
            print(
                f"{name} [{len(prompt)} prompt tokens] run {rep + 1}: plain {base['tps']:.1f} tok/s"
            )
            for k in ks:
                r = decode(model, prompt, args.tokens, PromptLookup(), k)
                same = "same tokens" if r["tokens"] == base["tokens"] else "DIFFERENT TOKENS"
                acc = r["accepted"] / r["drafted"] if r["drafted"] else 0.0
                print(
                    f"  prompt lookup k={k}: {r['tps']:.1f} tok/s = {r['tps'] / base['tps']:.2f}x, "
                    f"drafted {r['drafted']}, accepted {acc:.0%}, {same}"
                )
        r = decode(model, prompt, args.tokens // 2, DraftModel(model), ks[0])
        same = r["tokens"] == decode(model, prompt, args.tokens // 2, None, 0)["tokens"]
        acc = r["accepted"] / r["drafted"] if r["drafted"] else 0.0
        print(
            f"  draft model (itself) k={ks[0]}: accepted {acc:.0%}, "
            f"{'same tokens' if same else 'DIFFERENT TOKENS'}"
        )
    costs = step_costs(model, chat(PROSE), ks)
    base = costs[0]
    print("step cost (forward over k + 1 tokens / one decode step): " + ", ".join(
        f"k={k}: {costs[k] / base:.2f}" for k in ks
    ))  # fmt: skip


if __name__ == "__main__":
    main()
