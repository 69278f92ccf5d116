"""Log-probability entries stay JSON numbers whatever the step's values (a masked token's
-inf, a broken model's NaN): a response with them would otherwise be a 500. A token's text
is decoded once per tokenizer (a batch asking for alternatives decodes hundreds a step)."""

from __future__ import annotations

import json
import math

import pytest

pytestmark = pytest.mark.tiny


class _Tokenizer:
    def decode(self, ids: list[int]) -> str:
        return f"t{ids[0]}"


@pytest.mark.parametrize("bad", [math.nan, -math.inf])
def test_non_finite_values_become_the_floor_and_leave_the_alternatives(bad: float) -> None:
    import mlx.core as mx

    from mlx_server.engine.sampling.logprobs import LOGPROB_FLOOR, logprob_entry

    logprobs = mx.array([bad, -0.5, -1.0, bad])
    entry = logprob_entry(_Tokenizer(), 0, logprobs, k=4)
    assert entry.logprob == LOGPROB_FLOOR
    assert [t.token for t in entry.top] == ["t1", "t2"]
    json.dumps([entry.logprob, *(t.logprob for t in entry.top)], allow_nan=False)


def test_a_finite_value_is_kept() -> None:
    import mlx.core as mx

    from mlx_server.engine.sampling.logprobs import logprob_entry

    entry = logprob_entry(_Tokenizer(), 1, mx.array([-2.0, -0.25]), k=1)
    assert entry.logprob == -0.25 and [t.token for t in entry.top] == ["t1"]


@pytest.mark.parametrize("k", [0, 1, 3])
def test_figures_picked_in_the_step_give_the_entry_read_from_the_row(k: int) -> None:
    """The lone path makes a request's figures in the step's own graph (``pick``: read
    without waiting for the next step); the entry is the one read from the row, a masked
    alternative left out and a non-finite chosen value floored alike."""
    import mlx.core as mx

    from mlx_server.engine.sampling.logprobs import logprob_entry, pick

    mx.random.seed(2)
    row = mx.random.normal((50,))
    row = row - mx.logsumexp(row)
    row[7] = -math.inf  # a token a grammar masked
    for token in (3, 7, int(mx.argmax(row).item())):
        picked = pick(row, mx.array([token]), k)
        mx.eval(picked.arrays())
        assert (picked.top_ids is None) == (k == 0)
        assert logprob_entry(_Tokenizer(), token, row, k, picked) == logprob_entry(
            _Tokenizer(), token, row, k
        )


def test_the_lone_path_picks_the_figures_of_a_request_with_logprobs_only(tiny_model_dir) -> None:
    """A request with ``logprobs`` gets its figures with each step's token (the entry they
    give is the one the row gives); one without gets none (no work per step)."""
    from mlx_lm import load

    from mlx_server.engine.runners.base import Insert
    from mlx_server.engine.runners.solo import SoloSequence
    from mlx_server.engine.sampling.logprobs import logprob_entry
    from mlx_server.engine.sampling.samplers import make_sampler
    from mlx_server.types import GenerationRequest, SamplingParams

    model, _ = load(str(tiny_model_dir))
    greedy = make_sampler(SamplingParams(temperature=0.0))
    for logprobs, k in ((True, 2), (True, 0), (False, 0)):
        req = GenerationRequest("r", [1, 2, 3, 4], 3, logprobs=logprobs, top_logprobs=k)
        seq = SoloSequence(model, Insert(0, req, [1, 2, 3, 4], 0, None, greedy, []), [], 64)
        out = []
        while seq.emitted < 3:
            out += seq.next()[1]
        assert len(out) == 3
        if not logprobs:
            assert [r.picked for r in out] == [None] * 3
            continue
        for r in out:
            assert r.picked is not None and (r.picked.top_ids is None) == (k == 0)
            entry = logprob_entry(_Tokenizer(), r.token, r.logprobs, k, r.picked)
            assert entry == logprob_entry(_Tokenizer(), r.token, r.logprobs, k)
            assert len(entry.top) == k


class CountingTokenizer:
    def __init__(self) -> None:
        self.calls = 0

    def decode(self, ids: list[int]) -> str:
        self.calls += 1
        return f"<{ids[0]}>é"


class Unreferenced:
    """A tokenizer that cannot be weakly referenced."""

    __slots__ = ("calls",)

    def __init__(self) -> None:
        self.calls = 0

    def decode(self, ids: list[int]) -> str:
        self.calls += 1
        return f"[{ids[0]}]"


def test_a_tokens_text_is_decoded_once_per_tokenizer() -> None:
    from mlx_server.engine.sampling.logprobs import token_text

    tok, other = CountingTokenizer(), CountingTokenizer()
    assert token_text(tok, 7) == ("<7>é", "<7>é".encode())
    assert token_text(tok, 7) == ("<7>é", "<7>é".encode()) and tok.calls == 1
    assert token_text(tok, 8)[0] == "<8>é" and tok.calls == 2
    assert token_text(other, 7)[0] == "<7>é" and other.calls == 1  # each its own
    bare = Unreferenced()
    assert token_text(bare, 3) == token_text(bare, 3) == ("[3]", b"[3]") and bare.calls == 2
