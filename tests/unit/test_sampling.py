"""Samplers: ``ignore_eos`` is a row added inside the sampler (no logits processor, so the
lone path keeps no token context and a batch samples in one call), and it holds for every
row of a batch, greedy or sampled, seeded or not."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest

from mlx_server.engine.sampling.samplers import (
    SamplerPool,
    ban_tokens,
    make_sampler,
    sequence_sampling,
)
from mlx_server.types import GenerationRequest, SamplingParams

pytestmark = pytest.mark.tiny

VOCAB = 64
EOS = (3, 7)


def favouring(ids: tuple[int, ...], rows: int = 2) -> mx.array:
    """Log-probabilities of ``rows`` rows where ``ids`` are by far the likeliest."""
    logits = mx.zeros((rows, VOCAB))
    logits[:, mx.array(list(ids))] = 30.0
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def test_the_ban_sets_only_the_banned_ids_to_minus_infinity():
    lp = favouring(EOS)
    out = ban_tokens([7, 3, 3, VOCAB + 5])(lp)  # an id past the width is left out
    assert out.shape == lp.shape
    row = out[1].tolist()
    assert row[3] == row[7] == -float("inf")
    others = [(v, w) for i, (v, w) in enumerate(zip(row, lp[1].tolist(), strict=True))]
    assert all(v == pytest.approx(w) for i, (v, w) in enumerate(others) if i not in EOS)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, top_p=0.9, seed=11),
        SamplingParams(temperature=0.7, min_p=0.05, top_k=5),
    ],
    ids=["greedy", "unseeded", "seeded-top-p", "min-p-top-k"],
)
def test_a_banning_sampler_never_picks_a_banned_id(params):
    sampler = make_sampler(params, ban=EOS)
    lp = favouring(EOS, rows=4)
    picks = [t for _ in range(25) for t in sampler(lp).tolist()]
    assert len(picks) == 100 and not set(picks) & set(EOS)
    assert set(make_sampler(params)(lp).tolist()) <= set(EOS)  # without the ban they win


def test_same_settings_share_one_sampler_and_the_ban_is_part_of_them():
    pool = SamplerPool()
    greedy = SamplingParams(temperature=0.0)
    checked: list[object] = []
    a = pool.get(greedy, checked.append, EOS)
    b = pool.get(SamplingParams(temperature=0.0, repetition_penalty=1.2), checked.append, EOS)
    c = pool.get(greedy, checked.append)
    assert a is b and a is not c and len(checked) == 2
    assert a is not None and c is not None
    lp = favouring(EOS)
    assert not set(a(lp).tolist()) & set(EOS) and set(c(lp).tolist()) <= set(EOS)


class _Seq:
    fault: str | None = None
    shared = None


@pytest.mark.parametrize("seed", [None, 5])
def test_ignore_eos_adds_no_logits_processor(seed):
    params = SamplingParams(temperature=0.0 if seed is None else 0.8, seed=seed)
    req = GenerationRequest("r", [1, 2], 8, sampling=params, ignore_eos=True)
    sampler, processors = sequence_sampling(_Seq(), req, SamplerPool(), VOCAB, list(EOS))
    assert processors == []
    assert not set(sampler(favouring(EOS)).tolist()) & set(EOS)


@pytest.mark.parametrize("dtype", [None, "bfloat16", "float16"])
@pytest.mark.parametrize("seed", [None, 5])
def test_a_sampler_is_checked_in_the_logits_dtype(monkeypatch, dtype, seed):
    """The check before a request joins the batch runs in the model's logits dtype (on CUDA a
    float32 check built kernels no step used, seconds each on a fresh machine)."""
    from mlx_server.engine.sampling import samplers

    seen: list[object] = []
    real = samplers.make_sampler

    def recording(params, ban=()):
        inner = real(params, ban)
        return lambda logprobs: seen.append(logprobs.dtype) or inner(logprobs)

    monkeypatch.setattr(samplers, "make_sampler", recording)
    want = getattr(mx, dtype) if dtype else None
    req = GenerationRequest("r", [1, 2], 8, sampling=SamplingParams(temperature=0.7, seed=seed))
    sequence_sampling(_Seq(), req, SamplerPool(), VOCAB, list(EOS), want)
    assert seen == [want or mx.float32]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_the_truncations_and_the_draw_give_mlx_lms_results_with_settings_as_arrays(dtype):
    """Top-p, min-p and the temperature enter the compiled kernels as arrays (one kernel for
    every value, where a number baked in builds kernels per value: seconds each on CUDA);
    the results are mlx-lm's, value for value and draw for draw."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_p, categorical_sampling

    from mlx_server.engine.sampling import samplers

    mx.random.seed(3)
    logits = (mx.random.normal((4, 500)) * 3).astype(dtype)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    for top_p in (0.05, 0.5, 0.9, 0.999):
        ours = samplers._top_p(lp, samplers._Scalar(top_p, mx.float32).get())
        assert mx.array_equal(ours, apply_top_p(lp, top_p)).item(), top_p
    for min_p in (0.01, 0.2, 0.9):
        ours = samplers._min_p(lp, samplers._Scalar(math.log(min_p)).get(dtype))
        assert mx.array_equal(ours, apply_min_p(lp, min_p)).item(), min_p
    for temp in (0.3, 0.7, 1.5):
        mx.random.seed(9)
        theirs = categorical_sampling(lp, temp)
        mx.random.seed(9)
        ours = samplers._draw(lp, samplers._Scalar(1 / temp).get(dtype))
        assert ours.tolist() == theirs.tolist(), temp


def test_a_sampler_builds_its_setting_arrays_once_per_dtype():
    """The setting arrays are made on first use in each dtype and reused after (no array,
    no graph per step)."""
    from mlx_server.engine.sampling import samplers

    s = samplers._Scalar(0.5)
    a, b, c = s.get(mx.float16), s.get(mx.float16), s.get(mx.float32)
    assert a is b and a is not c and a.dtype == mx.float16 and c.dtype == mx.float32
    assert samplers._Scalar(0.9, mx.float32).get(mx.bfloat16).dtype == mx.float32


def test_a_min_p_above_one_fails_the_sampler_not_the_server():
    with pytest.raises(ValueError, match="min_p"):
        make_sampler(SamplingParams(temperature=0.7, min_p=1.5))
