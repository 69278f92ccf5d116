"""Speculative decoding on every layer kind: greedy output equals mlx-lm's own decoding.

Sliding-window layers (past their window), recurrent layers and attention sinks cannot be
trimmed after a verify pass; the rollback restores them and feeds the accepted tokens
again. The drafts here are the true continuation with wrong tokens mixed in, so every
step both accepts and rejects; the prompts are longer than the models' window.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import arch_models
import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models.cache import ArraysCache, KVCache
from spec_arch import WINDOW, build_arch_model, build_varied

from mlx_server.engine.speculative.batch import BatchSpeculator, RowSpec, install
from mlx_server.engine.speculative.drafters import DraftModel, PredictedOutput, PromptLookup
from mlx_server.engine.speculative.rollback import rollback_problem
from mlx_server.engine.speculative.runner import Speculation
from mlx_server.engine.speculative.sequence import SpeculativeSequence

pytestmark = pytest.mark.tiny

FAMILIES = ["llama", "gemma3_text", "gpt_oss", "qwen3_5", "gemma4_text"]
N = 24


def greedy(x: mx.array) -> mx.array:
    return mx.argmax(x, axis=-1)


@pytest.fixture(scope="module", params=FAMILIES)
def arch(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = build_arch_model(tmp_path_factory.mktemp("arch") / request.param, request.param)
    model, tokenizer = load(str(path))[:2]
    text = "The quick brown fox jumps over the lazy dog. def add(a, b): return a + b\n" * 2
    prompt = list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
    )
    assert len(prompt) > 2 * WINDOW
    want = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=N, sampler=greedy)]
    return request.param, model, prompt, want


class Mixed:
    """Drafts the true continuation with every ``wrong_every``-th position changed."""

    def __init__(self, prompt_len: int, answer: list[int], wrong_every: int):
        self.start, self.answer, self.wrong_every = prompt_len, answer, wrong_every

    def propose(self, context: list[int], k: int) -> list[int]:
        at = len(context) - self.start
        out = self.answer[at : at + k]
        return [t + 1 if (at + i) % self.wrong_every == 0 else t for i, t in enumerate(out)]


def speculate(
    model: Any, prompt: list[int], drafter: Any, k: int = 4, eos: list[int] | None = None
) -> list[int]:
    return speculate_to_end(model, prompt, drafter, k, eos or [])[0]


def speculate_to_end(
    model: Any, prompt: list[int], drafter: Any, k: int, eos: list[int]
) -> tuple[list[int], Any]:
    """The tokens, and the finishing response (its cache for the prefix cache)."""
    seq = SpeculativeSequence(
        model,
        1,
        prompt,
        0,
        None,
        sampler=greedy,
        greedy=True,
        drafter=drafter,
        num_draft_tokens=k,
        max_tokens=N,
        eos=eos,
        prefill_step_size=32,  # the prompt prefills in chunks, as in the server
        adaptive=False,
    )
    out: list[int] = []
    for _ in range(10 * N + 50):  # bounded: every decode step emits a token
        for r in seq.next()[1]:
            out.append(r.token)
            if r.finish_reason is not None:
                assert r.all_tokens == seq.fed == (prompt + out)[: len(seq.fed)]
                return out, r
    raise AssertionError("the sequence did not finish")


@pytest.mark.parametrize("k", [4, Speculation().num_draft_tokens])
def test_greedy_output_is_mlx_lm_s_with_rejected_drafts(arch: Any, k: int) -> None:
    """Also at the server's default width (15: a pass over 16 rows, the sliding window's
    size here) and with drafts accepted in runs longer than the window."""
    _, model, prompt, want = arch
    assert speculate(model, prompt, Mixed(len(prompt), want, 3), k) == want
    assert speculate(model, prompt, Mixed(len(prompt), want, 19), k) == want


def test_passes_queued_behind_whole_ones_give_mlx_lm_s_output(arch: Any) -> None:
    """Runs of drafts accepted whole, each broken by a wrong token: where the cache trims
    exactly, each pass after a whole one is queued before that one is read, and dropped
    when that one is not accepted whole (``sequence.py``); elsewhere passes are read one
    at a time. Either way the output is mlx-lm's."""
    _, model, prompt, want = arch
    assert speculate(model, prompt, Mixed(len(prompt), want, 11)) == want


def test_a_stop_inside_accepted_tokens_leaves_the_cache_at_the_stop(arch: Any) -> None:
    """The sequence ends on an accepted draft token: the cache it leaves for the prefix
    cache holds the context up to that token, and continues as plain decoding does."""
    _, model, prompt, want = arch
    end = next(i for i in range(6, N) if want[i] not in want[:i])  # a first occurrence
    out, last = speculate_to_end(model, prompt, Mixed(len(prompt), want, 7), 8, [want[end]])
    assert out == want[: end + 1] and last.finish_reason == "stop"
    more = generate_step(
        mx.array([want[end]]), model, max_tokens=4, sampler=greedy, prompt_cache=last.prompt_cache
    )
    longer = generate_step(mx.array(prompt), model, max_tokens=end + 5, sampler=greedy)
    assert [int(t) for t, _ in more] == [int(t) for t, _ in longer][end + 1 :]


def test_predicted_output_with_an_edit_keeps_greedy_output(arch: Any) -> None:
    _, model, prompt, want = arch
    prediction = [*want[:5], 7, 8, 9, *want[5:]]  # an insertion the model does not make
    assert speculate(model, prompt, PredictedOutput(prediction, len(prompt))) == want


def test_prompt_lookup_keeps_greedy_output(arch: Any) -> None:
    _, model, prompt, want = arch
    assert speculate(model, prompt, PromptLookup()) == want


def test_a_draft_model_of_the_same_kind_keeps_greedy_output(arch: Any, tmp_path: Path) -> None:
    family, model, prompt, want = arch
    # Other weights: most drafts are rejected, so the draft model's own cache (of the same
    # layer kinds) is rolled back at nearly every step.
    draft = load(str(build_arch_model(tmp_path / "draft", family, seed=1)))[0]
    assert speculate(model, prompt, DraftModel(draft, prefill_step_size=32), k=3) == want


# ---- every family of the architecture matrix ------------------------------------------------


@pytest.mark.parametrize("family", sorted(arch_models.FAMILIES))
def test_every_family_keeps_greedy_output_with_rejected_drafts(family: str, tmp_path: Path) -> None:
    model = load(str(build_varied(family, tmp_path / family)))[0]
    prompt = list(range(5, 5 + 3 * arch_models.WINDOW))  # past every sliding window
    want = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=N, sampler=greedy)]
    assert speculate(model, prompt, Mixed(len(prompt), want, 3)) == want
    default = Speculation().num_draft_tokens  # a pass wider than some families' windows
    assert speculate(model, prompt, Mixed(len(prompt), want, 19), default) == want


# ---- batched: mlx-lm's BatchGenerator with the speculating batch installed ------------------


def batched(
    model: Any, prompts: list[list[int]], answers: list[list[int]] | None, k: int = 4
) -> Any:
    """Each row's greedy tokens: plain batched decoding, or (with ``answers``) speculating
    on drafts of the answers with a wrong token every third position; and how many drafted
    tokens were accepted."""
    gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4)
    spec = BatchSpeculator(k, adaptive=False)
    if answers is not None:
        install(gen, spec)
    uids = gen.insert(prompts, max_tokens=[N] * len(prompts))
    for uid, p, a in zip(uids, prompts, answers or [], strict=False):
        spec.rows[uid] = RowSpec(Mixed(len(p), a, 3))
    out: dict[int, list[int]] = {u: [] for u in uids}
    done, accepted = 0, 0
    for _ in range(10 * N + 50):  # bounded: every step answers every row
        for r in gen.next_generated():
            out[r.uid].append(r.token)
            done += r.finish_reason is not None
        accepted += sum(a for _, a in spec.counts.values())
        if done == len(uids):
            gen.close()
            return [out[u] for u in uids], accepted
    raise AssertionError("the batch did not finish")


@pytest.mark.parametrize("k", [4, Speculation().num_draft_tokens])
def test_batched_speculation_keeps_greedy_output(arch: Any, k: int) -> None:
    _, model, prompt, _ = arch
    prompts = [prompt, prompt[:-9] + prompt[-5:], prompt[3:]]  # three lengths
    want, _ = batched(model, prompts, None)
    got, accepted = batched(model, prompts, want, k)
    assert got == want
    assert accepted > 0


# ---- the start-up check ---------------------------------------------------------------------


class OddLayer:
    """A cache layer of a kind the rollback does not know."""


class OddModel:
    def make_cache(self) -> list[Any]:
        return [KVCache(), OddLayer()]


def test_a_cache_layer_the_rollback_does_not_know_refuses_speculation_at_start() -> None:
    from types import SimpleNamespace

    from mlx_server.boot.chat import _speculation
    from mlx_server.config import Settings
    from mlx_server.models.base import ModelLoadError

    assert rollback_problem([KVCache(), ArraysCache(2)]) is None
    with pytest.raises(ModelLoadError, match="OddLayer"):
        _speculation(SimpleNamespace(), Settings(model="m", prompt_lookup=True), OddModel())
    # Without a flag asking for it the server starts; predicted outputs do not speculate.
    assert _speculation(SimpleNamespace(), Settings(model="m"), OddModel()) is None
