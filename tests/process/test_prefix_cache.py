"""The prefix cache: reuse across turns and shared system prompts, bounded, and exact — a
cached answer at temperature 0 equals the uncached one."""

from __future__ import annotations

import httpx
import mlx.core as mx
import pytest
from engine_runner import (
    chat_tokens,
    drive,
    generate_all,
    load_varied_model,
    request,
    running_engine,
    solo,
)
from mlx_lm.models.cache import KVCache
from support import free_port

from mlx_server.engine.cache.prefix import SYSTEM, PrefixCache

SYSTEM_PROMPT = "You are a terse assistant. Answer in one short line about the capital of France."


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return load_varied_model(tmp_path_factory)


# ---- the cache itself -----------------------------------------------------------------


def kv(n: int) -> list[KVCache]:
    """A one-layer KV state holding exactly ``n`` tokens (values = positions)."""
    c = KVCache()
    pos = mx.arange(n, dtype=mx.float32).reshape(1, 1, n, 1)
    c.keys, c.values, c.offset = pos, pos, n
    return [c]


def test_exact_hit_is_rewound_by_one_token():
    pc = PrefixCache(4, 1 << 30)
    pc.insert(list(range(10)), kv(10))
    cache, rest = pc.fetch(list(range(10)))
    assert rest == [9]
    assert cache is not None and cache[0].offset == 9
    # The stored entry is a separate copy, untouched by the caller's trim.
    again, rest2 = pc.fetch(list(range(10)))
    assert rest2 == [9] and again is not None and again[0].offset == 9


def test_longer_entry_is_trimmed_to_the_shared_prefix():
    pc = PrefixCache(4, 1 << 30)
    pc.insert(list(range(10)), kv(10))
    cache, rest = pc.fetch([0, 1, 2, 3, 99, 100])
    assert rest == [99, 100] and cache is not None and cache[0].offset == 4
    cache, rest = pc.fetch([0, 1, 2, 3, 4])  # a prompt that is a prefix of the entry
    assert rest == [4] and cache is not None and cache[0].offset == 4
    assert pc.fetch([7, 8]) == (None, [7, 8])
    assert pc.hits == 2 and pc.misses == 1


def test_system_entries_outlive_conversations():
    pc = PrefixCache(3, 1 << 30)
    system = [1, 2, 3]
    pc.insert(system, kv(3), SYSTEM)
    pc.insert(system + [4, 5], kv(5))  # a longer entry does not replace the system one
    assert sorted(map(len, pc.keys())) == [3, 5]
    for i in range(5):  # conversation pressure evicts conversations, oldest first
        pc.insert([9, i, i, i], kv(4))
    assert pc.keys(SYSTEM) == [system]
    assert len(pc) == 3
    cache, rest = pc.fetch(system + [7, 7])
    assert rest == [7, 7] and cache is not None and cache[0].offset == 3


def test_system_entries_take_at_most_half_the_slots():
    pc = PrefixCache(4, 1 << 30)
    for i in range(4):
        pc.insert([i, 0, 0], kv(3), SYSTEM)
    pc.insert([9, 9, 9, 9], kv(4))
    assert pc.keys(SYSTEM) == [[2, 0, 0], [3, 0, 0]]
    assert pc.keys("assistant") == [[9, 9, 9, 9]]


def test_hits_refresh_recency():
    pc = PrefixCache(2, 1 << 30)
    pc.insert([1, 1, 1], kv(3))
    pc.insert([2, 2, 2], kv(3))
    pc.fetch([1, 1, 1, 5])  # uses the older entry
    pc.insert([3, 3, 3], kv(3))
    assert sorted(pc.keys()) == [[1, 1, 1], [3, 3, 3]]


def test_byte_limit_is_enforced():
    one = sum(c.nbytes for c in kv(8))
    pc = PrefixCache(100, int(2.5 * one))
    for i in range(6):
        pc.insert([i] * 8, kv(8))
        assert pc.nbytes <= 2.5 * one
    assert len(pc) == 2 and pc.keys() == [[4] * 8, [5] * 8]


# ---- through the engine -----------------------------------------------------------------


def conversation(i: int) -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"Question {i}: what is the capital of France?"},
    ]


def test_later_turns_reuse_the_prefix_and_match_a_cold_engine(lm):
    model, tokenizer, _ = lm
    with (
        running_engine(model, tokenizer) as warm,
        running_engine(model, tokenizer, prompt_cache_size=0) as cold,
    ):
        convs = [conversation(i) for i in range(3)]
        for turn in range(3):
            for msgs in convs:  # interleaved, so entries of several conversations coexist
                ids = chat_tokens(tokenizer, msgs)
                (w,) = solo(warm, [request(ids, 20)])
                (c,) = solo(cold, [request(ids, 20)])
                assert w.text == c.text
                assert w.finished.usage.prompt_tokens == len(ids)
                assert w.finished.timings.cache_n == w.cached
                assert c.cached == 0
                if turn > 0:
                    assert w.cached > len(ids) // 2
                msgs += [
                    {"role": "assistant", "content": w.text},
                    {"role": "user", "content": f"And after turn {turn}?"},
                ]
        stats = warm.stats()
        assert stats["prompt_cache_hits"] >= 6


def test_repeated_and_exact_prompts_match_a_cold_engine(lm):
    model, tokenizer, _ = lm
    ids = chat_tokens(tokenizer, conversation(7))
    with (
        running_engine(model, tokenizer) as warm,
        running_engine(model, tokenizer, prompt_cache_size=0) as cold,
    ):
        first, again = solo(warm, [request(ids, 12), request(ids, 12)])
        assert again.cached == len(ids) - 1  # the stored entry is longer: trimmed to the prompt
        assert first.text == again.text == solo(cold, [request(ids, 12)])[0].text
        assert warm.prefix_cache is not None
        (stored,) = [k for k in warm.prefix_cache.keys() if k[: len(ids)] == ids]
        assert len(stored) == len(ids) + 12
        # A prompt equal to a stored entry: the exact hit is rewound by one token.
        exact = solo(warm, [request(stored, 12)])[0]
        assert exact.cached == len(stored) - 1
        assert exact.text == solo(cold, [request(stored, 12)])[0].text


def test_concurrent_conversations_share_a_cached_system_prompt(lm):
    model, tokenizer, _ = lm
    prompts = [chat_tokens(tokenizer, conversation(i)) for i in range(5)]
    with (
        running_engine(model, tokenizer) as warm,
        running_engine(model, tokenizer, prompt_cache_size=0) as cold,
    ):
        solo(warm, [request(prompts[0], 8)])
        batch = drive(warm, generate_all(warm, [request(p, 16) for p in prompts[1:]]))
        expected = solo(cold, [request(p, 16) for p in prompts[1:]])
    assert [b.text for b in batch] == [e.text for e in expected]
    shared = len(chat_tokens(tokenizer, [conversation(0)[0]]))  # at least the system turn
    assert all(b.cached >= shared - 2 for b in batch)


def test_eviction_under_a_tiny_byte_budget_stays_correct(lm):
    model, tokenizer, _ = lm
    budget = 250_000  # two or three conversations of the tiny model (512 B a token)
    with (
        running_engine(model, tokenizer, prompt_cache_size=16, prompt_cache_bytes=budget) as warm,
        running_engine(model, tokenizer, prompt_cache_size=0) as cold,
    ):
        convs = [conversation(10 + i) for i in range(4)]
        cached: list[int] = []
        sizes: list[int] = []
        for msgs in [*convs, convs[0]]:  # three turns each, then the first one again
            for _turn in range(3):
                ids = chat_tokens(tokenizer, msgs)
                (w,) = solo(warm, [request(ids, 16)])
                (c,) = solo(cold, [request(ids, 16)])
                assert w.text == c.text
                cached.append(w.cached)
                sizes.append(len(ids))
                pc = warm.prefix_cache
                assert pc is not None and pc.nbytes <= budget
                msgs += [
                    {"role": "assistant", "content": w.text},
                    {"role": "user", "content": "Go on."},
                ]
        stats = warm.stats()
    # Later turns reuse their own conversation's previous turn...
    for i in range(4):
        assert cached[3 * i + 1] > sizes[3 * i] and cached[3 * i + 2] > sizes[3 * i + 1]
    # ...but by the time the first conversation comes back, its entries were evicted for
    # bytes: only the system prompt shared with the others is still found.
    assert 0 < cached[12] < sizes[2]
    assert stats["prompt_cache_entries"] <= 3


def test_system_prompt_prefix_stays_cached_after_its_conversations_age_out(lm):
    from mlx_server.service import ChatService
    from mlx_server.types import ChatRequest

    model, tokenizer, _ = lm

    def conv(system: str, user: str) -> tuple[list[int], int]:
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        ids = chat_tokens(tokenizer, msgs)
        service = ChatService("m", tokenizer, None, ctx_size=1024)
        prepared = service.prepare(ChatRequest(msgs))
        assert prepared.tokens == ids
        return ids, service.system_prefix_tokens(ChatRequest(msgs), prepared)

    other = "Another long system prompt, about the quick brown fox and the lazy dog."
    first, boundary = conv(SYSTEM_PROMPT, "hello")
    assert 0 < boundary < len(first)
    assert (
        chat_tokens(tokenizer, [{"role": "system", "content": SYSTEM_PROMPT}])[: boundary - 4]
        == first[: boundary - 4]
    )
    with (
        running_engine(model, tokenizer, prompt_cache_size=4) as warm,
        running_engine(model, tokenizer, prompt_cache_size=0) as cold,
    ):

        def run(engine, ids_and_boundary):
            ids, end = ids_and_boundary
            return solo(engine, [request(ids, 12, system_prefix_tokens=end)])[0]

        run(warm, (first, boundary))
        pc = warm.prefix_cache
        assert pc is not None and pc.keys(SYSTEM) == [first[:boundary]]
        for user in ("one", "two", "three"):
            run(warm, conv(other, user))
        assert all(k[:boundary] != first[:boundary] for k in pc.keys("assistant"))
        later = conv(SYSTEM_PROMPT, "a different question entirely")
        w = run(warm, later)
        assert w.cached == boundary
        assert w.text == run(cold, later).text


def test_stopped_and_cancelled_sequences_leave_reusable_state(lm):
    model, tokenizer, _ = lm
    ids = chat_tokens(tokenizer, conversation(42))

    async def cancel_after(engine, n):
        handle = engine.submit(request(ids, 200))
        pieces = 0
        async for _ in handle:
            pieces += 1
            if pieces == n:
                handle.cancel()
        return pieces

    with (
        running_engine(model, tokenizer) as warm,
        running_engine(model, tokenizer, prompt_cache_size=0) as cold,
    ):
        drive(warm, cancel_after(warm, 4))
        assert warm.prefix_cache is not None and len(warm.prefix_cache) == 1
        (again,) = solo(warm, [request(ids, 10)])
        assert again.cached == len(ids) - 1
        assert again.text == solo(cold, [request(ids, 10)])[0].text


# ---- over HTTP ------------------------------------------------------------------------


def _chat(base: str, messages: list[dict], **extra) -> dict:
    body = {"model": "m", "messages": messages, "max_tokens": 16, "temperature": 0, **extra}
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_http_reports_cached_tokens_and_matches_a_cold_server(lm, server_factory):
    _, _, model_dir = lm
    common = ["-m", str(model_dir), "--ctx-size", "1024"]
    warm = server_factory([*common, "--port", str(free_port())])
    cold = server_factory([*common, "--port", str(free_port()), "--prompt-cache-size", "0"])
    msgs = conversation(3)
    for turn in range(2):
        w = _chat(warm.base_url, msgs)
        c = _chat(cold.base_url, msgs)
        answer = w["choices"][0]["message"]["content"]
        assert answer == c["choices"][0]["message"]["content"]
        cached = w["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert c["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert (cached > 0) == (turn > 0)
        assert w["timings"]["cache_n"] == cached
        msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": "More?"}]
    body = {"model": "m", "max_tokens": 8, "system": SYSTEM_PROMPT, "messages": msgs[1:]}
    r = httpx.post(f"{warm.base_url}/v1/messages", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["cache_read_input_tokens"] > 0
