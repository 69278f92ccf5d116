"""Lockstep serving's parts that need no second process: the prefix cache a follower rebuilds
from rank 0's journal, the sampler groups, the Llama pipeline's wrapping, the refusals and
the choice of sharding."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from mlx_server.engine.cache.prefix import SYSTEM, PrefixCache
from mlx_server.engine.lockstep.leader import tokens_key
from mlx_server.engine.lockstep.samplers import SamplerGroups


def kv_state(n: int) -> list[KVCache]:
    """A one-layer KV cache holding ``n`` tokens (16 bytes per token and side)."""
    cache = KVCache()
    cache.update_and_fetch(mx.zeros((1, 1, n, 4)), mx.zeros((1, 1, n, 4)))
    return [cache]


class Mirror:
    """A follower's prefix cache, fed rank 0's journal as the follower replays it."""

    def __init__(self) -> None:
        self.cache = PrefixCache(1 << 62, 1 << 62)
        self.states: dict[str, list[int]] = {}
        self.journal: list[tuple[str, list[int], str]] = []

    def note(self, event: str, tokens: list[int], kind: str) -> None:
        self.journal.append((event, list(tokens), kind))

    def replay(self) -> None:
        for event, tokens, kind in self.journal:
            if event == "store":
                assert tokens_key(tokens) in self.states  # the runner gave this state
                self.cache.insert(tokens, kv_state(len(tokens)), kind)
            else:
                self.cache.forget(tokens)
        self.journal.clear()


def test_a_follower_prefix_cache_keeps_what_rank_0_keeps():
    rng = random.Random(0)
    unit = kv_state(1)[0].nbytes  # a short state's allocation, whatever its length
    leader = PrefixCache(5, int(3.5 * unit))  # five entries, or three by bytes
    mirror = Mirror()
    leader.on_change = mirror.note
    systems = [[1, 2, 3], [1, 2, 4, 5]]
    for i in range(300):
        base = list(rng.choice(systems))
        tokens = base + [rng.randrange(6, 12) for _ in range(rng.randrange(1, 60))]
        if rng.random() < 0.5 and leader.keys():
            tokens = list(rng.choice(leader.keys())) + tokens[-3:]  # a conversation goes on
        kind = SYSTEM if i % 9 == 0 else "assistant"
        mirror.states[tokens_key(tokens)] = tokens
        leader.insert(tokens, kv_state(len(tokens)), kind)
        if i % 25 == 0:
            leader.evict_bytes(leader.nbytes // 3)
        mirror.replay()
        assert sorted(map(tuple, leader.keys())) == sorted(map(tuple, mirror.cache.keys()))
        probe = tokens[: rng.randrange(1, len(tokens) + 1)] + [rng.randrange(6, 12)]
        assert leader.cached_length(probe) == mirror.cache.cached_length(probe)
    assert leader.evictions > 0


def test_forget_drops_exactly_one_entry():
    cache = PrefixCache(8, 1 << 30)
    cache.insert([1, 2, 3], kv_state(3), SYSTEM)
    cache.insert([1, 2, 3, 4, 5], kv_state(5))
    cache.forget([1, 2])  # none of that exact prefix: nothing happens
    cache.forget([1, 2, 3, 4, 5])
    assert cache.keys() == [[1, 2, 3]]
    assert cache.nbytes == kv_state(3)[0].nbytes


def test_sampler_groups_share_one_wrapper_per_group_while_in_use():
    made: list[object] = []

    def wrap(source: object) -> object:
        made.append(source)
        return lambda lp: lp

    groups = SamplerGroups(wrap)  # type: ignore[arg-type]
    shared, own = object(), object()
    a, ga = groups.join(1, id(shared), shared)
    b, gb = groups.join(2, id(shared), shared)
    c, gc = groups.join(3, id(own), own)
    assert a is b and ga == gb and c is not a and gc != ga
    groups.leave([1])
    assert groups.join(4, id(shared), shared)[0] is a  # uid 2 still uses it
    groups.leave([2, 4])
    again, g_again = groups.join(5, id(shared), shared)
    assert again is not a and g_again not in (ga, gc)  # a new group: a new number
    assert len(groups) == 2 and made == [shared, own, shared]
    groups.leave([3, 5, 99])
    assert len(groups) == 0


def test_the_llama_pipeline_on_one_rank_computes_the_model(tiny_model_dir):
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    from mlx_server.models import llama_pipeline

    model, _ = load(str(tiny_model_dir))
    piped, _ = load(str(tiny_model_dir), lazy=True)
    assert llama_pipeline.supports(piped)
    llama_pipeline.pipeline(piped, mx.distributed.init())  # a group of one: every layer here
    mx.eval(piped.parameters())
    tokens = mx.array([[5, 9, 12, 7, 3, 11]])
    caches = make_prompt_cache(model), make_prompt_cache(piped)
    for step in (tokens[:, :4], tokens[:, 4:5], tokens[:, 5:]):
        want = model(step, cache=caches[0])
        got = piped(step, cache=caches[1])
        assert mx.allclose(want, got, atol=1e-5).item()


@pytest.mark.parametrize(
    ("n", "size", "split"), [(30, 2, [15, 15]), (5, 2, [3, 2]), (2, 2, [1, 1])]
)
def test_layer_split_gives_rank_0_the_extra_layers(n, size, split):
    from mlx_server.models.llama_pipeline import layer_split

    assert layer_split(n, size) == split


def test_sharding_choices_and_their_errors(tiny_model_dir):
    from mlx_lm.utils import load

    from mlx_server.models.base import ModelLoadError
    from mlx_server.models.sharding import choose

    model, _, config = load(str(tiny_model_dir), lazy=True, return_config=True)
    assert choose("auto", model, config, 2) == "pipeline"
    assert choose("tensor", model, config, 2) == "tensor"  # 4 heads, 2 KV heads
    with pytest.raises(ModelLoadError, match="2 key-value heads do not divide evenly by 4"):
        choose("tensor", model, config, 4)
    with pytest.raises(ModelLoadError, match="3 ranks need at least 3 layers"):
        choose("pipeline", model, config, 3)


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        (["--prompt-lookup"], "speculative decoding"),
        (["--kv-bits", "8"], "quantized KV cache"),
        (["--ranks", "3"], "--ranks 3, but mlx.launch started 2"),
    ],
)
def test_what_cannot_run_across_ranks_is_refused(tiny_model_dir, flags, why):
    from mlx_server.boot.sharded import refusal
    from mlx_server.cli import parse_settings

    settings = parse_settings(["--model", str(tiny_model_dir), *flags], environ={})
    assert why in (refusal(settings, 2) or "")
    plain = parse_settings(["--model", str(tiny_model_dir)], environ={})
    assert refusal(plain, 2) is None


def test_several_models_are_refused(tiny_model_dir, tmp_path):
    from mlx_server.boot.sharded import refusal
    from mlx_server.cli import parse_settings

    settings = parse_settings(
        ["--model", str(tiny_model_dir), "--models-dir", str(tmp_path)], environ={}
    )
    assert "several models" in (refusal(settings, 2) or "")
