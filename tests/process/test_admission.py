"""Memory admission: requests wait for KV budget in a bounded queue; a full queue answers
503 (529 on /v1/messages) with Retry-After; a request larger than the budget answers 400."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from engine_runner import collect, drive, load_varied_model, request, running_engine, solo, until
from support import free_port

from mlx_server.errors import InvalidRequest, Overloaded

PER_TOKEN = 256  # KV bytes per token given to the engine in the engine-level tests


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return load_varied_model(tmp_path_factory)


def prompts(tokenizer, n: int) -> list[list[int]]:
    return [list(tokenizer.encode(f"request {i}: the quick brown fox")) for i in range(n)]


def test_a_burst_beyond_the_kv_budget_queues_and_all_complete(lm):
    model, tokenizer, _ = lm
    ps = prompts(tokenizer, 5)
    budget = PER_TOKEN * 100  # room for one request of ~15 + 60 tokens, not two
    seen: list[int] = []

    async def burst(engine):
        handles = [engine.submit(request(p, 60)) for p in ps]
        queued = engine.queue_depth

        async def consume(h):
            text = ""
            async for ev in h:
                seen.append(engine.active_count)
                text += getattr(ev, "text", "")
            return text, ev.reason

        return queued, await asyncio.gather(*(consume(h) for h in handles))

    with running_engine(
        model, tokenizer, prompt_cache_size=0, kv_budget_bytes=budget, kv_bytes_per_token=PER_TOKEN
    ) as engine:
        alone = solo(engine, [request(p, 60) for p in ps])
        queued, results = drive(engine, burst(engine))
        assert engine.stats()["kv_in_use_bytes"] == 0
    assert queued >= 3  # at most one was admitted (and none finished) while submitting
    assert max(seen) == 1
    assert results == [(a.text, "length") for a in alone]


def test_a_full_queue_refuses_with_overloaded(lm):
    model, tokenizer, _ = lm
    ps = prompts(tokenizer, 8)

    async def burst(engine):
        handles, refused = [], 0
        for p in ps:
            try:
                handles.append(engine.submit(request(p, 40)))
            except Overloaded as e:
                refused += 1
                assert "queue is full" in e.message and e.retry_after >= 1
        results = await asyncio.gather(*(collect(h) for h in handles))
        return refused, results

    with running_engine(
        model,
        tokenizer,
        max_queue=2,
        kv_budget_bytes=PER_TOKEN * 100,
        kv_bytes_per_token=PER_TOKEN,
    ) as engine:
        refused, results = drive(engine, burst(engine))
        assert engine.queue_depth == 0 and engine.active_count == 0
    assert refused >= 8 - 3  # two queued, at most one already admitted
    assert all(r.reason == "length" for r in results)


def test_a_request_larger_than_the_budget_is_refused_with_the_reason(lm):
    model, tokenizer, _ = lm

    async def submit(engine):
        engine.submit(request(prompts(tokenizer, 1)[0], 1000))

    with running_engine(
        model, tokenizer, kv_budget_bytes=PER_TOKEN * 500, kv_bytes_per_token=PER_TOKEN
    ) as engine:
        with pytest.raises(InvalidRequest) as info:
            drive(engine, submit(engine))
        assert engine.queue_depth == 0
        (ok,) = solo(engine, [request(prompts(tokenizer, 1)[0], 8)])
    # Worded as a context overflow (Jan reloads with a larger context on it), naming the
    # longest context the memory for KV holds.
    assert info.value.code == "context_length_exceeded"
    assert "max_tokens 1000" in info.value.message
    assert "exceeds the available context size" in info.value.message
    assert "memory for KV holds 500 tokens" in info.value.message
    assert ok.reason == "length"


def test_a_cancelled_queued_request_frees_its_queue_slot(lm):
    model, tokenizer, _ = lm
    p = prompts(tokenizer, 3)

    async def run(engine):
        running = engine.submit(request(p[0], 300))
        task = asyncio.ensure_future(collect(running))
        await until(lambda: engine.active_count, "the first request to run")
        waiting = engine.submit(request(p[1], 10))
        with pytest.raises(Overloaded):
            engine.submit(request(p[2], 10))
        waiting.cancel()
        await until(lambda: not engine.queue_depth, "the cancelled request to leave the queue")
        third = await collect(engine.submit(request(p[2], 10)))
        return await collect(waiting), third, await task

    with running_engine(
        model, tokenizer, max_queue=1, kv_budget_bytes=PER_TOKEN * 400, kv_bytes_per_token=PER_TOKEN
    ) as engine:
        waiting, third, first = drive(engine, run(engine))
    assert waiting.reason == "cancelled" and waiting.finished.usage.completion_tokens == 0
    assert third.reason == first.reason == "length"


# ---- over HTTP ------------------------------------------------------------------------


@pytest.mark.timeout(600)  # a server, and requests it may answer in up to 300 s
def test_http_overload_oversize_and_health(lm, server_factory):
    from mlx_server.models.loader import load_model

    _, _, model_dir = lm
    per_token = load_model(str(model_dir)).kv_bytes_per_token  # the server's own estimate
    budget_gb = per_token * 2100 / (1 << 30)  # room for one request of ~2,010 tokens, not two
    srv = server_factory(
        [
            *("-m", str(model_dir), "--port", str(free_port()), "--ctx-size", "4096"),
            *("--kv-budget-gb", f"{budget_gb:.10f}", "--max-queue", "1"),
        ]
    )
    base = srv.base_url
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}

    big = httpx.post(f"{base}/v1/chat/completions", json={**chat, "max_tokens": 3000}, timeout=60)
    assert big.status_code == 400
    assert big.json()["error"]["code"] == "context_length_exceeded"
    assert "memory for KV holds" in big.json()["error"]["message"]

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{base}{path}", json=body, timeout=300)

    def wait_for(active: int, queued: int) -> None:
        deadline = time.time() + 60
        while time.time() < deadline:
            h = httpx.get(f"{base}/health", timeout=10).json()
            if (h["active"], h["queued"]) == (active, queued):
                return
            time.sleep(0.01)
        raise AssertionError(f"health never showed active={active}, queued={queued}: {h}")

    long = {**chat, "max_tokens": 2000, "ignore_eos": True}
    anthropic = {"model": "m", "max_tokens": 200, "messages": chat["messages"]}
    with ThreadPoolExecutor(10) as pool:
        # One runs and one waits for memory: the queue (of one) is full.
        holders = [pool.submit(post, "/v1/chat/completions", long)]
        wait_for(1, 0)
        holders.append(pool.submit(post, "/v1/chat/completions", long))
        wait_for(1, 1)
        jobs = [("/v1/chat/completions", {**chat, "max_tokens": 200})] * 3
        jobs += [("/v1/messages", anthropic)] * 3
        responses = [f.result() for f in [pool.submit(post, p, b) for p, b in jobs]]
        assert [h.result().status_code for h in holders] == [200, 200]

    for (path, _), r in zip(jobs, responses, strict=True):
        assert r.headers.get("retry-after", "").isdigit(), (path, r.status_code, r.text)
        if path == "/v1/messages":
            assert r.status_code == 529
            assert r.json()["error"]["type"] == "overloaded_error"
        else:
            assert r.status_code == 503
            assert "queue is full" in r.json()["error"]["message"]

    after = httpx.post(f"{base}/v1/chat/completions", json={**chat, "max_tokens": 8}, timeout=60)
    assert after.status_code == 200 and srv.proc.poll() is None
