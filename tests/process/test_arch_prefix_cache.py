"""An agent session through the real server on every kind of cache: plain KV (llama),
hybrid recurrent + attention (qwen3_5), sliding window past its size (gemma3_text). Turns 2
and 3 are served the previous turn's whole prompt (less at most its last token) from the
RAM tier, a restarted server from the disk tier; the output is mlx-lm's own; and the server
keeps answering after more distinct long prompts than the RAM tier holds."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from arch_models import build
from support import free_port
from test_metrics import scrape

pytestmark = pytest.mark.tiny

# About 600 tokens of system prompt (the tiny tokenizer has a small vocabulary); the user
# turns differ.
SYSTEM = "You are a coding agent. Read the files, run the tests, report tersely. " * 11
TURNS = ["List the files.", "Now run the tests.", "Summarise the failures."]
# What the client sends back as the model's earlier answers: templates like Qwen3's drop the
# reasoning of earlier turns, so the next prompt extends the previous prompt, not its answer.
ANSWER = "<think>The user wants this done.</think>Done."
MAX_TOKENS = 3


def messages(turn: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": SYSTEM}]
    for i in range(turn + 1):
        msgs.append({"role": "user", "content": TURNS[i]})
        if i < turn:
            msgs.append({"role": "assistant", "content": ANSWER})
    return msgs


def post(srv, path: str, body: dict) -> dict:
    r = httpx.post(srv.base_url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def chat(srv, turn: int) -> dict:
    body = {"model": "m", "messages": messages(turn), "max_tokens": MAX_TOKENS}
    return post(srv, "/v1/chat/completions", {**body, "temperature": 0, "ignore_eos": True})


def cached(resp: dict) -> int:
    return int(resp["usage"]["prompt_tokens_details"]["cached_tokens"])


def health(srv) -> dict:
    return httpx.get(srv.base_url + "/health", timeout=10).json()


def args(model: Path, root: Path, port: int) -> list[str]:
    return [
        "-m", str(model), "--port", str(port), "--ctx-size", "4096",
        "--prompt-cache-dir", str(root), "--prompt-cache-size", "4",
    ]  # fmt: skip


def reference(model_dir: Path, turn: int) -> tuple[list[int], str]:
    """The prompt of ``turn`` as the family's template renders it, and mlx-lm's greedy
    text for it (``MAX_TOKENS`` tokens, end-of-sequence not honoured)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, tokenizer = load(str(model_dir))[:2]
    prompt = list(tokenizer.apply_chat_template(messages(turn), add_generation_prompt=True))
    steps = generate_step(mx.array(prompt), model, max_tokens=MAX_TOKENS)
    return prompt, tokenizer.decode([int(t) for t, _ in steps])


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gemma3_text"])
def test_an_agent_session_stays_cached(family, server_factory, tmp_path):
    model_dir = build(family, tmp_path / family)
    prompt3, want3 = reference(model_dir, 2)
    port = free_port()
    srv = server_factory(args(model_dir, tmp_path / "cache", port))
    turns = [chat(srv, t) for t in range(3)]
    sizes = [r["usage"]["prompt_tokens"] for r in turns]
    assert sizes[0] > 500 and sizes[2] == len(prompt3)
    assert cached(turns[1]) >= sizes[0] - 1 and cached(turns[2]) >= sizes[1] - 1
    # Turn 3 again as raw token ids: a cache hit, and mlx-lm's own text.
    body = {"model": "m", "prompt": prompt3, "max_tokens": MAX_TOKENS, "temperature": 0}
    again = post(srv, "/v1/completions", {**body, "ignore_eos": True})
    assert cached(again) == len(prompt3) - 1
    assert again["choices"][0]["text"] == want3
    srv.stop()  # what RAM holds goes to disk

    srv = server_factory(args(model_dir, tmp_path / "cache", port))
    restarted = chat(srv, 2)
    assert cached(restarted) >= sizes[1] - 1
    assert restarted["choices"][0]["message"] == turns[2]["choices"][0]["message"]
    stats = health(srv)
    assert stats["prompt_cache_disk_hits"] >= 1 and stats["prompt_cache_failures"] == 0


def test_many_distinct_prompts_on_a_hybrid_model(server_factory, tmp_path):
    """Ten times more distinct long prompts than the RAM tier's four slots: entries are
    evicted (to the disk tier) and every request is answered."""
    model_dir = build("lfm2", tmp_path / "lfm2")  # short convolutions: a quick prefill
    srv = server_factory(args(model_dir, tmp_path / "cache", free_port()))
    for n in range(40):
        system = f"Agent {n}. " + SYSTEM[:400]  # past the disk tier's 256-token minimum
        body = {
            "model": "m",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Go"}],
            "max_tokens": 1,
        }
        post(srv, "/v1/chat/completions", body)
    stats = health(srv)
    assert stats["prompt_cache_evictions"] > 0 and stats["prompt_cache_failures"] == 0
    assert stats["prompt_cache_entries"] <= 4
    assert stats["prompt_cache_miss_no_entry"] == 40  # unrelated prompts, all told so
    metrics = scrape(srv.base_url)
    reason = ("mlx_server_prefix_cache_misses_by_reason_total", (("reason", "no_entry"),))
    assert metrics[reason] == stats["prompt_cache_miss_no_entry"]
    assert metrics[("mlx_server_prefix_cache_failures_total", ())] == 0
