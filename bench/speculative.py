"""Speculative decoding against the server's own plain decoding, side by side in one run.

Every run goes through the engine as the server builds it (``speculative_support.streams``:
the lone-request runner for one stream, continuous batching for several, its warm-up
done, idle-time pieces included, before anything is timed), greedy, EOS ignored; the baseline is the same engine without speculation, run before and after each
speculating run (its ratio is to their mean). Workloads:

- ``code``: a 60-line source file asked back with one rename (prompt lookup's best case);
- ``prose``: an essay (its worst);
- ``predicted``: Predicted Outputs with one edit, the ceiling: each request's prediction is
  its own plain greedy answer (the engine's plain run) with a 10-token span in the middle changed (what a
  code-editing client sends: the old text, one change). Acceptance is then known, and the
  ratio is the speed of the machinery itself, an edit included. Where a pass over k + 1
  tokens flips near-ties (a random 4-bit model's greedy choices), the prediction is first
  settled (``--settle``): the speculating engine's own answer with the same edit.

Each runs at one stream and at ``--streams`` streams (each stream its own prompt), with
prompt lookup (or the predictions), and with random drafts (nothing to accept: the cost of
trying, which must stay near 1.0x). Each speculating run prints the plan's decisions (how
many steps drafted, why the others did not, the measured verify cost per batch size and
width over a plain step, the samples left out as kernel builds, how often and why drafting
stopped); each stream's text is compared with the plain run's, and where
one parts from plain greedy decoding the top-2 log-probability margin there is printed (a
near-tie is what another kernel's rounding flips). Then the step costs measured directly:
a forward pass over k + 1 tokens against a decode step, alone and at ``--streams`` rows.

    source scripts/openblas.sh
    python bench/speculative.py [--model models/smollm2-135m-instruct-f32] [--tokens 200]
        [--num-draft-tokens 15] [--repeat 1] [--streams 8] [--levels 1,8]
        [--workloads code,prose,predicted] [--no-random] [--dtype float16] [--random]
        [--json out.jsonl --label NAME] [--trace verify.log]

``--random`` replaces the model's weights with random ones (seeded). ``--trace FILE``
appends one line per verifying step before its pass runs (flushed): if a pass brings the
process down, the last line says its shape. Asserts nothing; read the ratios.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from pathlib import Path
from typing import Any

import mlx.core as mx
import speculative_support as sup

from mlx_server.engine.core.tuning import on_gpu
from mlx_server.engine.speculative.runner import Speculation

print = functools.partial(print, flush=True)  # noqa: A001 (progress while it runs)
REPO = Path(__file__).resolve().parents[1]
SOURCE = (REPO / "bench" / "data" / "code_edit_source.py.txt").read_text()
RENAMES = ["DraftCount", "Drafts", "DraftSize", "Lengths", "Planner", "Chooser", "KPick", "Dk"]
TOPICS = ["lighthouses", "the printing press", "bridges", "clocks", "sailing ships"]
TOPICS += ["windmills", "paper money", "telescopes"]
PROSE = (
    "Write an essay about the history of lighthouses: the first ones in antiquity, how "
    "their lamps and lenses changed, the lives of their keepers, and why few are staffed "
    "today."
)
RECORD: dict[str, Any] = {"path": None, "label": ""}


def code_edit(lines: int = 0, name: str = "DraftCount") -> str:
    """The code-edit prompt over the file's first ``lines`` lines (0: all of them)."""
    source = "".join(SOURCE.splitlines(keepends=True)[:lines]) if lines else SOURCE
    return (
        "Here is a Python file:\n```python\n" + source + "```\nRename the class DraftLength to "
        f"{name} and return the whole file, unchanged otherwise. Output only the code."
    )


def texts(workload: str, n: int, lines: int) -> list[str]:
    if workload == "prose":
        return [PROSE.replace("lighthouses", TOPICS[i % len(TOPICS)]) for i in range(n)]
    return [code_edit(lines, RENAMES[i % len(RENAMES)]) for i in range(n)]


def record(**fields: Any) -> None:
    """One JSON line (``--json``): the model, the row and its figures."""
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


def as_dtype(model: Any, dtype: Any) -> None:
    """Dequantize a quantized model and cast its floating weights to ``dtype``."""
    from mlx.utils import tree_map
    from mlx_lm.utils import dequantize_model

    dequantize_model(model)
    cast = lambda v: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v  # noqa: E731
    model.update(tree_map(cast, model.parameters()))
    mx.eval(model.parameters())


class Bench:
    def __init__(self, model: Any, tokenizer: Any, args: Any):
        self.model, self.tok, self.args = model, tokenizer, args
        self.vocab = int(model.args.vocab_size)
        self.eos = sorted(int(t) for t in tokenizer.eos_token_ids)
        self.trace = open(args.trace, "a", buffering=1) if args.trace else None  # noqa: SIM115

    def chat(self, text: str) -> list[int]:
        msgs = [{"role": "user", "content": text}]
        return list(self.tok.apply_chat_template(msgs, add_generation_prompt=True))

    def spec(self, k: int, lookup: bool, label: str, pipelined: bool | None = None) -> Any:
        from mlx_server.engine.speculative.plan_log import PlanLog

        trace = None
        if self.trace is not None:
            self.trace.write(f"== {label}\n")
            out = self.trace
            trace = lambda line: out.write(line + "\n")  # noqa: E731 (line-buffered: flushed)
        return Speculation(
            num_draft_tokens=k, prompt_lookup=lookup, log=PlanLog(trace), pipelined=pipelined
        )

    def workload(self, name: str, n: int) -> None:
        a = self.args
        prompts = [self.chat(t) for t in texts(name, n, a.code_lines)]
        refs: list[list[int]] | None = None
        preds = None
        sup.streams(self.model, self.tok, prompts, 4, None)  # warm-up: the shapes
        base = sup.streams(self.model, self.tok, prompts, a.tokens, None)
        if name == "predicted":
            # the engine's own plain answer (another path's can part from it at a near-tie
            # of a random model's logits: the random 8B's did at token 58-66)
            preds = [sup.edited(r, self.vocab) for r in base["tokens"]]
            preds = self.settle(prompts, preds, base["tokens"])
        kind = "predicted outputs" if preds else "prompt lookup"
        runs = [(f"{kind} k={k}", k) for k in a.ks]
        if a.compare_queued and n == 1:  # the lone sequence's passes, the other way
            other = "not queued" if on_gpu() else "queued"  # the server's default, reversed
            runs += [(f"{kind} k={k}, passes {other}", k) for k in a.ks]
        if not a.no_random:
            runs.append((f"random drafts k={a.ks[0]}", a.ks[0]))
        ratios: dict[str, list[float]] = {}
        for rep in range(a.repeat):
            for label, k in runs:
                rand = label.startswith("random")
                queued = {"passes queued": True, "passes not queued": False}.get(
                    label.rsplit(", ", 1)[-1]
                )  # None: the server's default
                spec = self.spec(k, preds is None, f"{name} x{n} {label}", queued)
                with sup.drafting(sup.RandomDrafts(self.vocab) if rand else None):
                    r = sup.streams(self.model, self.tok, prompts, a.tokens, spec, preds)
                after = sup.streams(self.model, self.tok, prompts, a.tokens, None)
                ratio = r["tps"] / ((base["tps"] + after["tps"]) / 2)
                by_cpu = r["cpu_tps"] / ((base["cpu_tps"] + after["cpu_tps"]) / 2)
                ratios.setdefault(label, []).append(ratio)
                ratios.setdefault(label + ", by CPU time", []).append(by_cpu)
                acc = r["accepted"] / r["drafted"] if r["drafted"] else 0.0
                same = sum(x == y for x, y in zip(r["texts"], base["texts"], strict=True))
                print(
                    f"{name}, {n} stream(s), run {rep + 1}: plain {base['tps']:.1f} then "
                    f"{after['tps']:.1f} tok/s, {label} {r['tps']:.1f} tok/s = {ratio:.2f}x "
                    f"(by CPU time {by_cpu:.2f}x), "
                    f"drafted {r['drafted']}, accepted {acc:.0%}, {same}/{n} streams the plain text"
                )
                print(spec.log.summary())
                if same < n:
                    refs = refs or sup.reference(self.model, prompts, a.tokens, self.eos)
                    self.partings(prompts, refs, base["texts"], r["texts"])
                base = after
        for label, rs in ratios.items():
            median = statistics.median(rs)
            print(f"  {name}, {n} stream(s), {label}: median {median:.2f}x of {len(rs)}")
            record(workload=name, streams=n, run=label, ratio=median, runs=len(rs))

    def settle(
        self, prompts: list[list[int]], preds: list[list[int]], answers: list[list[int]]
    ) -> list[list[int]]:
        """Predictions the speculating engine decodes as it would: on a random model whose
        greedy choices are near-ties at most tokens (the random 8B 4-bit: top-2 margins of
        0.005), a pass over k + 1 tokens flips some, the answer leaves the prediction and
        acceptance measures the ties, not the machinery. Up to ``--settle`` times, while the
        speculating answer is not the one the prediction came from, the prediction becomes
        that answer with the same edit. The plain baseline is unchanged (the same number of
        tokens, greedy)."""
        k = self.args.ks[0]
        for i in range(self.args.settle):
            spec = self.spec(k, lookup=False, label=f"settling {i + 1}")
            r = sup.streams(self.model, self.tok, prompts, self.args.tokens, spec, preds)
            acc = r["accepted"] / r["drafted"] if r["drafted"] else 0.0
            same = sum(a == b for a, b in zip(r["tokens"], answers, strict=True))
            print(f"  settling {i + 1}: accepted {acc:.0%}, {same}/{len(answers)} answers kept")
            if same == len(answers):
                break
            answers = r["tokens"]
            preds = [sup.edited(a, self.vocab) for a in answers]
        return preds

    def partings(
        self, prompts: list[list[int]], refs: list[list[int]], plain: list[str], spec: list[str]
    ) -> None:
        """For each stream whose speculating text is not the plain run's: where each parts
        from plain greedy decoding (the reference tokens), with the margin there."""
        for i, (p, ref, a, b) in enumerate(zip(prompts, refs, plain, spec, strict=True)):
            if a == b:
                continue
            for who, text in (("plain", a), ("speculating", b)):
                where = sup.parting(self.model, self.tok, p, ref, text)
                print(f"    stream {i}, {who} run: {where or 'plain greedy throughout'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO / "models" / "smollm2-135m-instruct-f32"))
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument(
        "--num-draft-tokens",
        default=str(Speculation.num_draft_tokens),
        help="draft lengths, comma-separated (default: the server's)",
    )
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--levels", default=None, help="stream counts (default 1 and --streams)")
    ap.add_argument("--workloads", default="code,prose,predicted")
    ap.add_argument("--no-random", action="store_true", help="skip the random-drafts runs")
    ap.add_argument("--random", action="store_true", help="random weights of the same shapes")
    ap.add_argument("--dtype", default=None, help="dequantize and cast: float16, bfloat16, ...")
    ap.add_argument("--json", default=None, help="append one JSON line per ratio to this file")
    ap.add_argument("--label", default="", help="the model's name in the JSON lines")
    ap.add_argument("--code-lines", type=int, default=0, help="the code edit's first N lines")
    ap.add_argument("--trace", default=None, help="one line per verifying step, before it runs")
    ap.add_argument("--no-step-costs", action="store_true")
    ap.add_argument(
        "--compare-queued",
        action="store_true",
        help="at one stream, also each drafter's run with its passes the other way: queued "
        "one behind another (the default on a GPU) or each read before the next is built",
    )
    ap.add_argument(
        "--settle",
        type=int,
        default=2,
        help="predicted: rounds making the prediction the speculating engine's own answer",
    )
    args = ap.parse_args()
    args.ks = [int(k) for k in args.num_draft_tokens.split(",")]
    levels = [int(n) for n in (args.levels or f"1,{args.streams}").split(",") if int(n) > 0]

    from mlx_lm import load

    model, tokenizer = load(args.model)
    if args.dtype:
        as_dtype(model, getattr(mx, args.dtype))
    if args.random:
        randomize(model)
    from mlx_server.models.cuda_paths import install_cuda_paths

    for line in install_cuda_paths(model):  # what the server's loader puts in place on CUDA
        print(line)
    RECORD.update(path=args.json, label=args.label or Path(args.model).name)
    print(f"mlx {mx.__version__} on {mx.default_device()}; {args.model}")
    bench = Bench(model, tokenizer, args)
    for n in dict.fromkeys(levels):
        for name in args.workloads.split(","):
            bench.workload(name, n)
    if not args.no_step_costs:
        prompt = bench.chat(PROSE)
        for b in dict.fromkeys([1, *levels]):
            costs = sup.step_costs(model, prompt, args.ks, batch=b)
            cells = ", ".join(f"k={k}: {costs[k] / costs[0]:.2f}" for k in args.ks)
            print(
                f"step cost at batch {b} (a pass over k + 1 tokens / one decode step, {costs[0] * 1e3:.2f} ms): {cells}"
            )
            record(
                run="step cost",
                streams=b,
                step_s=costs[0],
                costs={str(k): costs[k] / costs[0] for k in args.ks},
            )


if __name__ == "__main__":
    main()
