"""Checkpoints for caches that cannot be rewound (engine/cache/checkpoints.py): where the
prefill pauses, where a template's history ends, and the engine resuming from the state at
those points on a tiny Nemotron-H (Mamba, attention and MoE layers), alone and batched."""

from __future__ import annotations

import pytest
from arch_models import build
from engine_runner import drive, generate, generate_all, request, running_engine, solo

from mlx_server.engine.cache.checkpoints import MAX_CHUNKS, pauses
from mlx_server.engine.runners.base import Insert
from mlx_server.models.prompt import history_tokens
from mlx_server.service import ChatService
from mlx_server.types import ChatRequest

pytestmark = pytest.mark.tiny

SYSTEM = "You are a coding agent. Read the files, run the tests. "
ANSWER = "<think>The user wants this done.</think>Done."


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    from mlx_lm import load

    from mlx_server.models.base import settle_arrays

    model, tokenizer = load(str(build("nemotron_h", tmp_path_factory.mktemp("nh") / "nh")))[:2]
    settle_arrays(model)  # as the server's loader: the engine thread runs it
    return model, tokenizer


# ---- the plan ------------------------------------------------------------------------------


def test_pauses_at_the_history_end_and_spread_chunk_boundaries() -> None:
    assert pauses(100, 0, history_end=90, every=0) == (90,)
    assert pauses(100, 0, history_end=99, every=0) == ()  # the prompt's end: a segment anyway
    assert pauses(100, 90, history_end=90, every=0) == ()  # already cached
    assert pauses(100, 0, every=40) == (40, 80)
    # Past the cached part, at most MAX_CHUNKS, spread, the last boundary kept.
    bounds = pauses(1000, 150, every=100)
    assert len(bounds) == MAX_CHUNKS and bounds[-1] == 900 and bounds[0] > 150
    assert pauses(1000, 150, history_end=950, every=100) == (*bounds, 950)


def test_an_insert_is_fed_in_segments_split_at_its_pauses() -> None:
    job = Insert(0, None, list(range(20)), 2, None, None, system_end=5, checkpoints=(12, 5))  # type: ignore[arg-type]
    assert job.pauses == [5, 12]
    assert job.segments == [list(range(2, 5)), list(range(5, 12)), list(range(12, 20))]


# ---- where the history ends ------------------------------------------------------------------


def messages(turn: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": SYSTEM}]
    for i in range(turn + 1):
        msgs.append({"role": "user", "content": f"Question {i}?"})
        if i < turn:
            msgs.append({"role": "assistant", "content": ANSWER})
    return msgs


def build_turns(tokenizer, hints: bool = True):
    service = ChatService("nh", tokenizer, None, ctx_size=4096, history_ends=hints)  # type: ignore[arg-type]
    return [
        service.build_request(ChatRequest(messages(t), max_tokens=4), f"t{t}")[0] for t in range(3)
    ]


class CharTokenizer:
    """One token per character: ``history_tokens`` needs only ``encode``."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def test_no_history_end_unless_the_prompt_is_the_history_then_its_generation_prompt() -> None:
    tok = CharTokenizer()
    text = "<s>user: hi</s><a><think>"
    tokens = tok.encode(text)
    assert history_tokens(tok, tokens, text, "<s>user: hi</s>") == len("<s>user: hi</s>")
    assert history_tokens(tok, tokens, text, "<s>user: ho</s>") == 0  # not a prefix
    assert history_tokens(tok, tokens, text, text) == 0  # no generation prompt
    assert history_tokens(tok, tokens, text, "") == 0
    # The prompt's tokens do not end with the generation prompt's own: no boundary.
    assert history_tokens(tok, [*tokens[:-1], 0], text, "<s>user: hi</s>") == 0


def test_the_history_end_is_where_the_next_turn_goes_another_way(nemotron) -> None:
    """Nemotron-H's generation prompt opens ``<think>``, which the next turn's history does
    not repeat: the next prompt extends the history's end, not the prompt less a token."""
    turns = build_turns(nemotron[1])
    for this, following in zip(turns, turns[1:], strict=False):
        end = this.history_end
        assert 0 < end < len(this.prompt_tokens) - 1
        assert following.prompt_tokens[:end] == this.prompt_tokens[:end]
        last = len(this.prompt_tokens) - 1  # where the checkpoint at the prompt's end is
        assert following.prompt_tokens[:last] != this.prompt_tokens[:last]
    assert [t.history_end for t in build_turns(nemotron[1], hints=False)] == [0, 0, 0]


def test_no_history_checkpoint_where_the_next_turn_repeats_the_whole_prompt(tmp_path) -> None:
    """Qwen3's template: the next turn repeats ``<|im_start|>assistant\n`` (the checkpoint at
    the prompt's end serves it), but not the empty reasoning block it adds without thinking."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(build("qwen3", tmp_path / "qwen3"))
    service = ChatService("q", tokenizer, None, ctx_size=4096, history_ends=True)  # type: ignore[arg-type]

    def hint(**kw) -> tuple[int, int]:
        req = service.build_request(ChatRequest(messages(1), max_tokens=4, **kw), "q")[0]
        return req.history_end, len(req.prompt_tokens)

    assert hint()[0] == 0
    end, n = hint(template_kwargs={"enable_thinking": False})
    assert 0 < end < n - 1


# ---- the engine resumes there ------------------------------------------------------------------


def run(engine, reqs, together: bool):
    async def go():
        if together:
            return await generate_all(engine, reqs)
        return [await generate(engine, r) for r in reqs]

    return drive(engine, go())


@pytest.mark.parametrize("together", [False, True], ids=["alone", "batched"])
def test_the_next_turn_resumes_from_the_history_checkpoint(nemotron, together) -> None:
    model, tokenizer = nemotron
    turns = build_turns(tokenizer)

    def ask(req, **kw):
        hints = {"system_prefix_tokens": req.system_prefix_tokens, "history_end": req.history_end}
        return request(req.prompt_tokens, 4, ignore_eos=True, **hints, **kw)

    with running_engine(model, tokenizer, prompt_cache_size=0) as engine:
        cold = [r.text for r in solo(engine, [ask(t) for t in turns])]
    other = request([5, 6, 7] * 20, 4, ignore_eos=True)  # a second sequence: the batch runner
    with running_engine(model, tokenizer) as engine:
        first = run(engine, [ask(turns[0])] + ([other] if together else []), together)[0]
        second, third = solo(engine, [ask(turns[1]), ask(turns[2])])
    assert second.cached == turns[0].history_end and third.cached == turns[1].history_end
    assert [first.text, second.text, third.text] == cold


def test_a_long_prefix_resumes_from_a_chunk_checkpoint(nemotron) -> None:
    """Two prompts sharing 70 tokens, then different, with no hint: the second resumes from
    the first's chunk boundary at 64 (every 32 tokens, 2 kept: 32 and 64)."""
    model, tokenizer = nemotron
    shared = [(7 * i) % 150 + 20 for i in range(70)]
    a = shared + [30] * 20
    b = shared + [40] * 20
    with running_engine(model, tokenizer, prompt_cache_size=0) as engine:
        cold = solo(engine, [request(b, 4, ignore_eos=True)])[0].text
    with running_engine(model, tokenizer, checkpoint_every=32) as engine:
        solo(engine, [request(a, 4, ignore_eos=True)])
        (again,) = solo(engine, [request(b, 4, ignore_eos=True)])
        stats = engine.stats()
    assert again.cached == 64 and again.text == cold
    assert stats["prompt_cache_failures"] == 0
