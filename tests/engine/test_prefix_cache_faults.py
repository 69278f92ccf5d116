"""The prefix cache's own failures never reach a request, and caches that cannot be rewound
keep checkpoints: the engine on tiny hybrid and plain models, without HTTP."""

from __future__ import annotations

import pytest
from arch_models import build
from engine_runner import Result, drive, generate, generate_all, request, running_engine, solo

import mlx_server.engine.cache.disk as disk_cache
import mlx_server.engine.cache.prefix as prefix_cache
from mlx_server.engine.cache.disk import DiskPromptCache

pytestmark = pytest.mark.tiny


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from mlx_lm import load

    return load(str(build("qwen3_5", tmp_path_factory.mktemp("arch") / "qwen3_5")))[:2]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    from mlx_lm import load

    return load(str(build("llama", tmp_path_factory.mktemp("arch") / "llama")))[:2]


SYSTEM = [(5 * i + 11) % 150 + 20 for i in range(80)]


def prompt(n: int, length: int = 12) -> list[int]:
    """The shared system prefix, then a user turn distinct for each ``n``."""
    return SYSTEM + [(n * 31 + 7 * i) % 150 + 20 for i in range(length)]


def ask(tokens: list[int], **kw):
    return request(tokens, 6, ignore_eos=True, system_prefix_tokens=len(SYSTEM), **kw)


def within_deadline(engine, reqs: list, together: bool) -> list[Result]:
    """Run ``reqs`` (all at once, or one after another), failing after two minutes rather
    than waiting for ever on a sequence that never finishes."""

    async def run() -> list[Result]:
        if together:
            return await generate_all(engine, reqs)
        return [await generate(engine, r) for r in reqs]

    return drive(engine, run())


def cold_texts(model, tokenizer, prompts: list[list[int]]) -> list[str]:
    with running_engine(model, tokenizer, prompt_cache_size=0) as engine:
        return [r.text for r in solo(engine, [ask(p) for p in prompts])]


def test_a_disk_tier_that_fails_every_write_fails_no_request(hybrid, tmp_path, monkeypatch, capsys):
    model, tokenizer = hybrid
    prompts = [prompt(n) for n in range(9)]
    want = cold_texts(model, tokenizer, prompts)

    def broken(*_):
        raise OSError("no space left on device")

    monkeypatch.setattr(disk_cache, "serialize", broken)
    disk = DiskPromptCache(tmp_path, 1 << 30, min_tokens=8)
    # Two RAM slots: the system prompt's save, every finished state and every eviction
    # write to the broken disk.
    with running_engine(model, tokenizer, prompt_cache_disk=disk, prompt_cache_size=2) as engine:
        together = within_deadline(engine, [ask(p) for p in prompts[:3]], together=True)
        alone = within_deadline(engine, [ask(p) for p in prompts[3:]], together=False)
        stats = engine.stats()
    results = together + alone
    assert [r.reason for r in results] == ["length"] * len(prompts)
    assert [r.text for r in results] == want
    assert stats["prompt_cache_failures"] >= 3
    assert capsys.readouterr().out.count("no space left on device") == 1  # logged once


def test_an_entry_that_fails_to_load_is_a_miss_and_dropped(plain, monkeypatch, capsys):
    model, tokenizer = plain
    first, second = prompt(1, 40), prompt(1, 40)[:-10] + prompt(2, 10)
    (want,) = cold_texts(model, tokenizer, [second])

    def broken(*_):
        raise RuntimeError("cannot rewind")

    monkeypatch.setattr(prefix_cache, "trim_prompt_cache", broken)
    with running_engine(model, tokenizer) as engine:
        solo(engine, [request(first, 6, ignore_eos=True)])
        (got,) = solo(engine, [request(second, 6, ignore_eos=True)])
        stats = engine.stats()
    assert got.reason == "length" and got.text == want and got.cached == 0
    assert stats["prompt_cache_failures"] == 1 and stats["prompt_cache_miss_failed"] == 1
    assert "cannot rewind" in capsys.readouterr().out


ONE_WAY = ["qwen3_5", "nemotron_h", "lfm2", "granitemoehybrid", "gemma3_text", "gpt_oss"]


@pytest.mark.parametrize(
    "family, together",
    [("qwen3_5", True)] + [(f, False) for f in ONE_WAY],
    ids=["qwen3_5-batched", *ONE_WAY],
)
def test_a_cache_that_cannot_be_rewound_resumes_from_the_prompt_checkpoint(
    family, together, tmp_path
):
    """Turn 2 extends turn 1's prompt (not its answer): it resumes from turn 1's whole
    prompt but its last token; an exact repeat does too. Output as without the cache.
    Hybrid recurrent models, and sliding windows (16 tokens) the prompts pass."""
    from mlx_lm import load

    from mlx_server.models.base import settle_arrays

    model, tokenizer = load(str(build(family, tmp_path / family)))[:2]
    settle_arrays(model)  # as the server's loader: the engine thread runs it
    turn1 = prompt(1, 30)
    turn2 = turn1 + [(9 * i) % 150 + 20 for i in range(20)]
    want = cold_texts(model, tokenizer, [turn1, turn2])
    with running_engine(model, tokenizer) as engine:
        if together:  # the batch runner's path: a second request beside the first
            drive(engine, generate_all(engine, [ask(turn1), ask(prompt(7, 30))]))
        else:
            solo(engine, [ask(turn1)])
        again, extended = solo(engine, [ask(turn1), ask(turn2)])
        stats = engine.stats()
    assert again.cached == len(turn1) - 1 and extended.cached >= len(turn1) - 1
    assert [again.text, extended.text] == want
    assert stats["prompt_cache_miss_not_trimmable"] == 0


def test_a_miss_says_why(plain, capsys):
    model, tokenizer = plain
    with running_engine(model, tokenizer, prompt_cache_size=1) as engine:
        solo(engine, [request(p, 3) for p in ([1] + prompt(1), [2] + prompt(2), [1] + prompt(1))])
        stats = engine.stats()
    # The first: nothing stored; the third: its entry was evicted by the second's.
    assert stats["prompt_cache_miss_no_entry"] == 2 and stats["prompt_cache_miss_evicted"] == 1
    out = capsys.readouterr().out
    assert out.count("miss for a") == 3 and "evicted" in out


def test_a_short_prefix_before_a_long_rest_is_not_used_where_kernels_are_built_per_shape(
    plain, capsys
):
    """With ``prefill_buckets`` (CUDA): a hit of at most ``SHORT_CHUNK`` tokens before a
    longer rest prefills from the start (``short_prefix``); a hit before a short rest (a
    next turn), or a long hit, is used. Output is the same either way."""
    from mlx_server.engine.core.tuning import SHORT_CHUNK

    model, tokenizer = plain
    opening = SYSTEM[:20]  # a chat template's opening, stored with a first conversation
    first = opening + [7] * 10
    long_rest = opening + [(3 * i) % 150 + 20 for i in range(SHORT_CHUNK + 30)]
    short_rest = opening + [9] * 12
    want = cold_texts(model, tokenizer, [first, long_rest, short_rest])
    for buckets in (True, False):
        with running_engine(
            model, tokenizer, prompt_cache_size=4, prefill_buckets=buckets
        ) as engine:
            got = solo(engine, [ask(p) for p in (first, long_rest, short_rest)])
            stats = engine.stats()
        assert [r.text for r in got] == want
        if buckets:  # the long rest prefilled from the start; the short one used the hit
            assert stats["prompt_cache_miss_short_prefix"] == 1
            assert got[1].cached == 0 and got[2].cached > 0
        else:
            assert stats["prompt_cache_miss_short_prefix"] == 0 and got[1].cached > 0
    assert "short prefix" in capsys.readouterr().out


def own_system(n: int, length: int = 48) -> list[int]:
    """A system prompt of its own for each ``n`` (past the 16-token sliding window)."""
    return [(n * 17 + 5 * i) % 150 + 20 for i in range(length)]


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3_text", "deepseek_v3"])
def test_more_distinct_prompts_than_the_ram_tier_holds(family, tmp_path):
    """Twenty prompts, each with its own system prompt, through a RAM tier of four entries
    (the first alone, then four at a time): every one is answered, states leave RAM for the
    disk tier without a failure, and a repeat of the first is served from there with the
    first's output. Recurrent state (qwen3_5), a sliding window (gemma3_text), MLA latents
    (deepseek_v3)."""
    from mlx_lm import load

    from mlx_server.models.base import settle_arrays

    model, tokenizer = load(str(build(family, tmp_path / family)))[:2]
    settle_arrays(model)  # as the server's loader: the engine thread runs it
    prompts = [own_system(n) + [(n * 31 + 7 * i) % 150 + 20 for i in range(8)] for n in range(20)]

    def ask_own(tokens: list[int]):
        return request(tokens, 3, ignore_eos=True, system_prefix_tokens=len(tokens) - 8)

    disk = DiskPromptCache(tmp_path / "disk", 1 << 30, min_tokens=16)
    with running_engine(model, tokenizer, prompt_cache_disk=disk, prompt_cache_size=4) as engine:
        # The first alone (the repeat's reference), then the rest four at a time.
        results = within_deadline(engine, [ask_own(prompts[0])], together=False)
        for i in range(1, len(prompts), 4):
            results += within_deadline(engine, [ask_own(p) for p in prompts[i : i + 4]], True)
        assert disk.flush(30)
        (again,) = within_deadline(engine, [ask_own(prompts[0])], together=False)
        stats = engine.stats()
    assert [r.reason for r in results] == ["length"] * len(prompts)
    assert stats["prompt_cache_evictions"] > 0 and stats["prompt_cache_failures"] == 0
    assert stats["prompt_cache_entries"] <= 4 and stats["prompt_cache_disk_entries"] > 4
    assert stats["prompt_cache_disk_hits"] >= 1 and again.cached >= len(prompts[0]) - 8
    assert again.text == results[0].text
