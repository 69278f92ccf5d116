"""Rejection sampling against a draft model's probabilities: the emitted tokens have the
target's distribution, and the acceptance is the overlap of the two distributions.

Every test draws from seeded keys, so its counts are the same on every run; the bounds are
chi-square critical values at p = 1e-4 and acceptance within four standard deviations.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from typing import Any

import mlx.core as mx
import pytest
from engine_runner import build_varied_model
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlx_server.engine.sampling.samplers import make_distribution
from mlx_server.engine.speculative.drafters import DraftModel
from mlx_server.engine.speculative.rejection import (
    Draws,
    Rejection,
    speculative_sample,
    wants_rejection,
)
from mlx_server.engine.speculative.verify import verify_sampled
from mlx_server.types import SamplingParams

CRITICAL = {8: 31.83, 9: 33.72}  # chi-square at p = 1e-4 by degrees of freedom (scipy)


def chi_square(counts: Counter[int], probs: list[float], n: int) -> tuple[float, int]:
    """Pearson's statistic over the tokens with probability >= 1 %, plus one bin for the rest."""
    big = [t for t, p in enumerate(probs) if p >= 0.01]
    bins = [(counts[t], probs[t]) for t in big]
    bins.append((n - sum(c for c, _ in bins), 1.0 - sum(p for _, p in bins)))
    bins = [(c, p) for c, p in bins if p > 1e-9]
    return sum((c - n * p) ** 2 / (n * p) for c, p in bins), len(bins) - 1


def normalised(xs: list[float]) -> mx.array:
    a = mx.array(xs)
    return a / a.sum()


P = normalised([8, 5, 4, 3, 2, 1, 1, 0.5, 0.3, 0.2])  # the target at position 1
Q = normalised([1, 2, 6, 3, 0.5, 4, 1, 1, 0.3, 0.2])  # the draft at position 1
P2 = normalised([1, 1, 1, 6, 2, 0.4, 3, 0.5, 0.1, 2])  # the target at position 2
Q2 = normalised([1, 4, 1, 2, 2, 2, 1, 0.5, 0.1, 1])


def test_emitted_tokens_have_the_targets_distribution_whatever_the_draft() -> None:
    draws, n = Draws(seed=1), 4000
    p, q = mx.stack([P, P2, P2]), mx.stack([Q, Q2])
    firsts: Counter[int] = Counter()
    seconds: Counter[int] = Counter()
    accepted = 0
    for _ in range(n):
        draft = [draws.categorical(Q), draws.categorical(Q2)]
        out = speculative_sample(p, draft, q, draws)
        firsts[out[0]] += 1
        if len(out) > 1:  # the first draft token was accepted: the second is position 2's
            accepted += 1
            seconds[out[1]] += 1
    stat, dof = chi_square(firsts, P.tolist(), n)  # type: ignore[arg-type]
    assert stat < CRITICAL[dof], (stat, firsts)
    stat, dof = chi_square(seconds, P2.tolist(), accepted)  # type: ignore[arg-type]
    assert stat < CRITICAL[dof], (stat, seconds)
    # Acceptance at position 1 is the overlap sum(min(p, q)), a binomial proportion.
    overlap = mx.minimum(P, Q).sum().item()
    sd = math.sqrt(overlap * (1 - overlap) / n)
    assert abs(accepted / n - overlap) < 4 * sd
    # The check can fail: taking the draft token always gives the draft's distribution.
    taken: Counter[int] = Counter(draws.categorical(Q) for _ in range(2000))
    assert chi_square(taken, P.tolist(), 2000)[0] > CRITICAL[9]  # type: ignore[arg-type]


def test_a_draft_equal_to_the_target_is_always_accepted() -> None:
    draws = Draws(seed=2)
    p = mx.stack([P, P2, P2])
    for _ in range(200):
        draft = [draws.categorical(P), draws.categorical(P2)]
        assert speculative_sample(p, draft, mx.stack([P, P2]), draws)[:2] == draft


def test_only_unseeded_sampling_without_processors_uses_rejection() -> None:
    assert wants_rejection(SamplingParams(temperature=0.0), False) is None
    assert wants_rejection(SamplingParams(temperature=0.7, seed=3), False) is None
    assert wants_rejection(SamplingParams(temperature=0.7), True) is None
    assert wants_rejection(SamplingParams(temperature=0.7, top_p=0.9), False) is not None


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Any]:
    """The varied tiny model as the target and, as its draft, the same model with a
    perturbed output head: close to the target, not equal to it."""
    path = build_varied_model(tmp_path_factory.mktemp("rej") / "tiny-varied")
    target, tok = load(str(path))[:2]
    draft = load(str(path))[0]
    mx.random.seed(7)
    head = draft.lm_head.weight
    draft.lm_head.weight = head + 0.6 * mx.random.normal(head.shape) * head.std()
    return target, draft, tok


def test_a_draft_model_sampled_at_temperature_verifies_to_the_targets_distribution(
    pair: Any,
) -> None:
    """The target model verifying the draft model's sampled drafts of 2: the first emitted
    token follows the target's distribution at temperature 1, and drafts are accepted at
    the rate of the two models' overlap there."""
    target, draft_model, tok = pair
    params = SamplingParams(temperature=1.0)
    prompt = list(
        tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    )
    cache = make_prompt_cache(target)
    target(mx.array(prompt[:-1])[None], cache=cache)
    last = prompt[-1]
    dist = make_distribution(params)

    def probs(model: Any, ids: list[int]) -> mx.array:
        logits = model(mx.array(ids)[None])[0, -1:]
        return dist(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[0]

    p1, q1 = probs(target, prompt), probs(draft_model, prompt)
    rejection = Rejection(dist, Draws(seed=11))
    drafter = DraftModel(draft_model)
    firsts: Counter[int] = Counter()
    accepted, n = 0, 800
    for _ in range(n):
        drafted, q = drafter.propose_sampled(prompt, 2, rejection)
        assert q is not None and q.shape[0] == 2
        out = verify_sampled(target, copy.deepcopy(cache), last, drafted, q, rejection)
        firsts[out.tokens[0]] += 1
        accepted += out.accepted > 0
    stat, dof = chi_square(firsts, p1.tolist(), n)  # type: ignore[arg-type]
    assert stat < CRITICAL.get(dof, 40.0), (stat, dof, firsts.most_common(5))
    overlap = mx.minimum(p1, q1).sum().item()
    assert 0.2 < overlap < 0.95  # the draft differs from the target, but not entirely
    sd = math.sqrt(overlap * (1 - overlap) / n)
    assert abs(accepted / n - overlap) < 4 * sd, (accepted / n, overlap)


def test_a_batch_row_verifies_its_sampled_draft_by_rejection_beside_a_greedy_row() -> None:
    """``batch_verify.decide`` over two rows: row 0 sampled its draft from ``Q`` (rejection
    sampling against ``P``), row 1 is greedy with a draft of its own."""
    from types import SimpleNamespace

    from mlx_server.engine.sampling.samplers import SharedSampler, make_sampler
    from mlx_server.engine.speculative.batch_verify import decide

    greedy = SharedSampler(make_sampler(SamplingParams(temperature=0.0)))
    batch = SimpleNamespace(
        samplers=[greedy, greedy],
        fallback_sampler=greedy,
        logits_processors=[(), ()],
        tokens=[[1, 2], [3, 4]],
    )
    # Logits whose softmax is P at row 0's first position (P2 after), a peak at 4 for row 1.
    peak = mx.log(normalised([1, 1, 1, 1, 50, 1, 1, 1, 1, 1]))
    logits = mx.stack([mx.stack([mx.log(P), mx.log(P2), mx.log(P2)]), mx.stack([peak] * 3)])
    rejection = Rejection(make_distribution(SamplingParams(temperature=1.0)), Draws(seed=5))
    draws, n = Draws(seed=6), 3000
    firsts: Counter[int] = Counter()
    for _ in range(n):
        draft = [draws.categorical(Q), draws.categorical(Q2)]
        sampled = {0: (mx.stack([Q, Q2]), rejection)}
        rows = decide(batch, logits, [0, 0], [draft, [4, 7]], sampled, [(), ()])
        firsts[rows[0].tokens[0]] += 1
        assert rows[1].tokens == [4, 4]  # greedy: 4 accepted, 7 rejected for the argmax 4
    stat, dof = chi_square(firsts, P.tolist(), n)  # type: ignore[arg-type]
    assert stat < CRITICAL[dof], (stat, firsts)
