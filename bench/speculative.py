"""Speculative decoding against plain decoding, side by side in one run.

Workloads (greedy): a code edit (a 60-line source file in the prompt, asked back with one
change: prompt lookup's best case) and non-repetitive prose (its worst). Each runs on the
lone-request runner without speculation (``SoloSequence``) and with it
(``SpeculativeSequence``: prompt lookup, then the model drafting for itself), and the
output of each run is checked to be the same tokens. Then the step-cost model: a forward
pass over k + 1 tokens against a one-token decode step, which is what a draft of k costs.
Then ``--streams`` concurrent streams through the engine (continuous batching), each
workload with a different prompt per stream (renaming another class; another essay), with
prompt lookup (adaptive draft length, the server's default) and without: aggregate decode
tokens/s while every stream decodes, and whether each stream's text is the same.

    source scripts/openblas.sh
    python bench/speculative.py [--model models/smollm2-135m-instruct-f32] [--tokens 200]
        [--num-draft-tokens 4,8] [--repeat 2] [--streams 8] [--only lone|streams] [--random]
        [--predict] [--code-lines N]

``--random`` replaces the model's weights with random ones of the same shapes (seeded): its
text is noise, so drafts are rarely accepted and the figures are the cost of trying.
Each workload also runs with random drafts (next to nothing accepted): the cost of trying,
which the adaptive draft length must keep small. ``--predict`` adds, for the streams, a run where each request predicts its own answer (as
decoded alone): the most a verified draft can give on this machine.

Prints decode tokens/s, acceptance and ratios; asserts nothing. The machine may be shared:
run it more than once and read the ratios, not the absolute figures.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx

print = functools.partial(print, flush=True)  # noqa: A001 (progress while it runs)
REPO = Path(__file__).resolve().parents[1]
SOURCE = (REPO / "bench" / "data" / "code_edit_source.py.txt").read_text()


def code_edit(lines: int = 0) -> str:
    """The code-edit prompt over the file's first ``lines`` lines (0: all of them)."""
    source = "".join(SOURCE.splitlines(keepends=True)[:lines]) if lines else SOURCE
    return (
        "Here is a Python file:\n```python\n"
        + source
        + "```\nRename the class DraftLength to DraftCount and return the whole file, "
        "unchanged otherwise. Output only the code."
    )


CODE_EDIT = code_edit()
PROSE = (
    "Write an essay about the history of lighthouses: the first ones in antiquity, how "
    "their lamps and lenses changed, the lives of their keepers, and why few are staffed "
    "today."
)


class RandomDrafts:
    """Drafts random tokens (seeded): next to nothing is accepted, so a run with them
    measures what trying costs."""

    def __init__(self, vocab: int, seed: int = 0):
        import random

        self.vocab, self.rng = vocab, random.Random(seed)

    def propose(self, context: list[int], k: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(k)]


def greedy(x: mx.array) -> mx.array:
    return mx.argmax(x, axis=-1)


def decode(model: Any, prompt: list[int], n: int, drafter: Any, k: int) -> dict[str, Any]:
    """Decode ``n`` tokens (EOS ignored); tokens/s counted from the first token."""
    from mlx_server.engine.runners.base import Insert
    from mlx_server.engine.runners.solo import SoloSequence
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
    t_first = c_first = 0.0
    while True:
        _, responses = seq.next()
        for r in responses:
            if not tokens:
                t_first, c_first = time.perf_counter(), time.process_time()
            tokens.append(r.token)
        if responses and responses[-1].finish_reason is not None:
            break
    secs = time.perf_counter() - t_first
    cpu = time.process_time() - c_first
    drafted = getattr(seq, "draft_n", 0)
    accepted = getattr(seq, "draft_accepted", 0)
    return {
        "tokens": tokens,
        "tps": (len(tokens) - 1) / secs,
        # Per second of this process's CPU time: steadier than wall time on a shared CPU.
        "cpu_tps": (len(tokens) - 1) / cpu if cpu > 0 else 0.0,
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


RENAMES = ["DraftCount", "Drafts", "DraftSize", "Lengths", "Planner", "Chooser", "KPick", "Dk"]
TOPICS = [
    "lighthouses",
    "the printing press",
    "bridges",
    "clocks",
    "sailing ships",
    "windmills",
    "paper money",
    "telescopes",
]


def workloads(n: int, lines: int = 0) -> dict[str, list[str]]:
    """Per workload, ``n`` prompts of the same kind (the code edit over ``lines`` lines)."""
    edit = code_edit(lines)
    code = [edit.replace("DraftCount", RENAMES[i % len(RENAMES)]) for i in range(n)]
    prose = [PROSE.replace("lighthouses", TOPICS[i % len(TOPICS)]) for i in range(n)]
    return {"code edit": code, "prose": prose}


def streams(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    n: int,
    spec: Any,
    predictions: list[list[int]] | None = None,
) -> dict:
    """``len(prompts)`` streams of ``n`` tokens (EOS ignored) through one engine at once:
    decode tokens/s over the window in which every stream decodes, and the texts. With
    ``predictions``, each stream's request carries one (OpenAI's Predicted Outputs)."""
    import asyncio

    from mlx_server.engine.core.engine import Engine, EngineConfig
    from mlx_server.engine.core.handle import TokenPiece
    from mlx_server.events import Finished
    from mlx_server.types import GenerationRequest, SamplingParams

    cfg = EngineConfig(max_batch_size=len(prompts), prompt_cache_size=0, speculation=spec)
    engine = Engine(model, tokenizer, cfg)
    engine.start()

    async def one(i: int, p: list[int]) -> tuple[str, list[tuple[float, int]], Any]:
        pred = tuple(predictions[i]) if predictions else ()
        req = GenerationRequest(
            f"s{i}",
            p,
            n,
            SamplingParams(temperature=0.0),
            logprobs=True,
            ignore_eos=True,
            prediction_tokens=pred,
        )
        text, times = "", []
        async for ev in engine.submit(req):
            if isinstance(ev, TokenPiece):  # one log-probability entry per token
                text += ev.text
                times.append((time.perf_counter(), len(ev.logprobs)))
            elif isinstance(ev, Finished):
                return text, times, ev
        raise RuntimeError("no Finished")

    async def run() -> list[Any]:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    try:
        results = asyncio.run(run())
    finally:
        engine.shutdown(10)
    start = max(times[0][0] for _, times, _ in results)  # the last stream's first token
    end = min(times[-1][0] for _, times, _ in results)  # the first stream's last
    count = sum(k for _, times, _ in results for t, k in times if start < t <= end)
    drafted = sum(f.timings.draft_n for *_, f in results if f.timings)
    accepted = sum(f.timings.draft_n_accepted for *_, f in results if f.timings)
    return {
        "tps": count / (end - start) if end > start else 0.0,
        "texts": [text for text, _, _ in results],
        "drafted": drafted,
        "accepted": accepted,
    }


def as_dtype(model: Any, dtype: Any) -> None:
    """Dequantize a quantized model (the demo model is 4-bit) and cast its floating weights to
    ``dtype``: the demo model in float16, as a GPU serves it."""
    from mlx.utils import tree_map
    from mlx_lm.utils import dequantize_model

    dequantize_model(model)
    cast = lambda v: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v  # noqa: E731
    model.update(tree_map(cast, model.parameters()))
    mx.eval(model.parameters())


RECORD: dict[str, Any] = {"path": None, "label": ""}


def record(**fields: Any) -> None:
    """One JSON line (``--json``): the model, the row and its figures."""
    import json

    if RECORD["path"]:
        line = {
            "bench": "speculative",
            "model": RECORD["label"],
            "device": str(mx.default_device()),
        }
        with open(RECORD["path"], "a") as f:
            f.write(json.dumps({**line, **fields}) + "\n")


def randomize(model: Any) -> None:
    """Random weights of the same shapes and dtypes, seeded (norm weights stay at one)."""
    from mlx.utils import tree_flatten, tree_unflatten

    mx.random.seed(0)
    weights = [
        (k, v if k.endswith("norm.weight") else mx.random.normal(v.shape, v.dtype) * 0.05)
        for k, v in tree_flatten(model.parameters())
    ]
    model.update(tree_unflatten(weights))
    mx.eval(model.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO / "models" / "smollm2-135m-instruct-f32"))
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--num-draft-tokens", default="4,8")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--only", choices=["lone", "streams"], default=None)
    ap.add_argument("--random", action="store_true", help="random weights of the same shapes")
    ap.add_argument(
        "--dtype",
        default=None,
        help="float16, bfloat16 or float32: dequantize a quantized model and cast it",
    )
    ap.add_argument("--json", default=None, help="append one JSON line per ratio to this file")
    ap.add_argument("--label", default="", help="the model's name in the JSON lines")
    ap.add_argument(
        "--code-lines", type=int, default=0, help="streams: the code edit's first N lines"
    )
    ap.add_argument(
        "--predict", action="store_true", help="streams also with their answers as predictions"
    )
    args = ap.parse_args()

    from mlx_lm import load

    model, tokenizer = load(args.model)
    if args.dtype:
        as_dtype(model, getattr(mx, args.dtype))
    if args.random:
        randomize(model)
    RECORD.update(path=args.json, label=args.label or Path(args.model).name)
    ks = [int(k) for k in args.num_draft_tokens.split(",")]

    def chat(text: str) -> list[int]:
        msgs = [{"role": "user", "content": text}]
        return list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True))

    if args.only != "streams":
        lone(model, chat, args, ks)
    if args.only != "lone" and args.streams > 0:
        batched(model, tokenizer, chat, args, ks)


def batched(model: Any, tokenizer: Any, chat: Any, args: Any, ks: list[int]) -> None:
    """Each workload's streams: plain, then each speculating run followed by plain again;
    a run's ratio is to the mean of the plain runs on both sides (the first streams of an
    engine run slower while buffers are allocated, and the machine's load drifts)."""
    from mlx_server.engine.speculative.runner import Speculation

    vocab = int(model.args.vocab_size)
    for name, texts in workloads(args.streams, args.code_lines).items():
        prompts = [chat(t) for t in texts]
        streams(model, tokenizer, prompts, 4, None)  # warm-up: the batch's shapes
        preds = None
        if args.predict:  # each stream's own answer (alone) as its prediction
            preds = [decode(model, p, args.tokens, None, 0)["tokens"] for p in prompts]
        runs = [("prompt lookup", Speculation(num_draft_tokens=ks[0], prompt_lookup=True))]
        runs.append(("random drafts", Speculation(num_draft_tokens=ks[0], prompt_lookup=True)))
        if preds is not None:
            runs.append(("predicted outputs", Speculation(num_draft_tokens=ks[0])))
        ratios: dict[str, list[float]] = {}
        for rep in range(args.repeat):
            base = streams(model, tokenizer, prompts, args.tokens, None)
            for label, spec in runs:
                with random_drafts(vocab, on=label == "random drafts"):
                    r = streams(
                        model,
                        tokenizer,
                        prompts,
                        args.tokens,
                        spec,
                        preds if "pred" in label else None,
                    )
                after = streams(model, tokenizer, prompts, args.tokens, None)
                ratio = r["tps"] / ((base["tps"] + after["tps"]) / 2)
                ratios.setdefault(label, []).append(ratio)
                same = sum(a == b for a, b in zip(r["texts"], base["texts"], strict=True))
                acc = r["accepted"] / r["drafted"] if r["drafted"] else 0.0
                print(
                    f"{name}, {args.streams} streams, run {rep + 1}: plain {base['tps']:.1f} "
                    f"then {after['tps']:.1f} tok/s, {label} k<={ks[0]} {r['tps']:.1f} tok/s = "
                    f"{ratio:.2f}x, drafted {r['drafted']}, accepted {acc:.0%}, "
                    f"{same}/{args.streams} streams the same text"
                )
                base = after
        for label, rs in ratios.items():
            median = sorted(rs)[len(rs) // 2]
            print(f"  {name}, {args.streams} streams, {label}: median {median:.2f}x of {len(rs)}")
            record(
                workload=name, streams=args.streams, run=label, k=ks[0], ratio=median, runs=len(rs)
            )


@contextlib.contextmanager
def random_drafts(vocab: int, on: bool) -> Iterator[None]:
    """While on, every request the engine speculates for drafts ``RandomDrafts``."""
    from mlx_server.engine.speculative import batch_runner, runner

    saved = runner.make_drafter
    if on:
        fake = lambda *a, **kw: RandomDrafts(vocab)  # noqa: E731
        runner.make_drafter = batch_runner.make_drafter = fake  # type: ignore[assignment]
    try:
        yield
    finally:
        runner.make_drafter = batch_runner.make_drafter = saved


def lone(model: Any, chat: Any, args: Any, ks: list[int]) -> None:
    from mlx_server.engine.speculative.drafters import DraftModel, PromptLookup

    decode(model, chat("Hi"), 8, None, 0)  # warm-up
    vocab = int(model.args.vocab_size)
    for name, text in (("code edit", CODE_EDIT), ("prose", PROSE)):
        prompt = chat(text)
        ratios: dict[str, list[float]] = {}
        for rep in range(args.repeat):
            base = decode(model, prompt, args.tokens, None, 0)
            print(
                f"{name} [{len(prompt)} prompt tokens] run {rep + 1}: plain {base['tps']:.1f} tok/s"
            )
            drafters: list[tuple[str, Any, int]] = [
                (f"prompt lookup k={k}", PromptLookup(), k) for k in ks
            ]
            drafters.append((f"random drafts k={ks[0]}", RandomDrafts(vocab), ks[0]))
            for label, drafter, k in drafters:
                r = decode(model, prompt, args.tokens, drafter, k)
                # Plain again after each: the ratio is to the mean of the plain runs beside it.
                after = decode(model, prompt, args.tokens, None, 0)
                ratio = r["tps"] / ((base["tps"] + after["tps"]) / 2)
                cpu_ratio = r["cpu_tps"] / ((base["cpu_tps"] + after["cpu_tps"]) / 2)
                ratios.setdefault(label, []).append(ratio)
                ratios.setdefault(label + ", by CPU time", []).append(cpu_ratio)
                same = "same tokens" if r["tokens"] == base["tokens"] else "DIFFERENT TOKENS"
                acc = r["accepted"] / r["drafted"] if r["drafted"] else 0.0
                print(
                    f"  {label}: {r['tps']:.1f} tok/s = {ratio:.2f}x (by CPU time "
                    f"{cpu_ratio:.2f}x; plain after: {after['tps']:.1f}), "
                    f"drafted {r['drafted']}, accepted {acc:.0%}, {same}"
                )
                base = after
        for label, rs in ratios.items():
            median = sorted(rs)[len(rs) // 2]
            print(f"  {name}, {label}: median {median:.2f}x over {len(rs)} runs")
            record(workload=name, streams=1, run=label, ratio=median, runs=len(rs))
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
    record(run="step cost", step_s=base, costs={str(k): costs[k] / base for k in ks})


if __name__ == "__main__":
    main()
