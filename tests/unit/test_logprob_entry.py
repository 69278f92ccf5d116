"""Log-probability entries stay JSON numbers whatever the step's values (a masked token's
-inf, a broken model's NaN): a response with them would otherwise be a 500."""

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
