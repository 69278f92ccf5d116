"""Speculation through the real server on a hybrid model (qwen3_5: gated-delta layers and
full attention) with a draft model of the same kind: the server starts (it refused
hybrid models before), and greedy completions are mlx-lm's own ``generate`` on the same
prompt, alone and four at a time; Predicted Outputs give the text they give without."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import generate_step
from spec_arch import build_arch_model
from support import free_port, launch

pytestmark = pytest.mark.tiny

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "def add(a, b):\n    return a + b\n" * 3,
    "Hello world! What is the capital of France? " * 3,
    "Numbers 0 1 2 3 4 5 6 7 8 9 " * 3,
]
N = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("spec-http")
    target = build_arch_model(root / "target", "qwen3_5")
    draft = build_arch_model(root / "draft", "qwen3_5", seed=1)
    model, tokenizer = load(str(target))[:2]
    want = {}
    for p in PROMPTS:
        ids = tokenizer.encode(p)
        steps = generate_step(
            mx.array(ids), model, max_tokens=N, sampler=lambda x: mx.argmax(x, axis=-1)
        )
        want[p] = streamed_text(tokenizer, [int(t) for t, _ in steps])
    sp = launch(
        ["-m", str(target), "--port", str(free_port()), "--draft-model", str(draft)]
        + ["--max-batch-size", "4", "--prompt-cache-dir", ""]
    )
    try:
        assert sp.wait_ready(), sp.lines
        sp.want = want  # type: ignore[attr-defined]
        yield sp
    finally:
        sp.stop()


def streamed_text(tokenizer: Any, ids: list[int]) -> str:
    """The text mlx-lm's streaming detokenizer makes of ``ids``, as the server streams it
    (random tokens split UTF-8 sequences, which a whole decode joins differently), less
    the leading space (the server keeps the first token's)."""
    detok = tokenizer.detokenizer
    detok.reset()
    for t in ids:
        detok.add_token(t)
    detok.finalize()
    return str(detok.text).lstrip(" ")


def complete(sp: Any, prompt: str, **kw: Any) -> str:
    body = {"model": "m", "prompt": prompt, "max_tokens": N, "temperature": 0, **kw}
    r = httpx.post(f"{sp.base_url}/v1/completions", json={**body, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"]).lstrip(" ")


def test_the_start_up_log_says_how_speculation_rolls_back(server: Any) -> None:
    line = server.wait_for_line("Speculative decoding: on")
    assert "ArraysCache" in line and "fed the accepted tokens again" in line


def test_greedy_completions_alone_are_mlx_lm_s(server: Any) -> None:
    for p in PROMPTS[:2]:
        assert complete(server, p) == server.want[p]


def test_greedy_completions_in_a_batch_are_mlx_lm_s(server: Any) -> None:
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: complete(server, p), PROMPTS))
    assert got == [server.want[p] for p in PROMPTS]


def test_drafts_were_verified(server: Any) -> None:
    r = httpx.get(f"{server.base_url}/metrics", timeout=30)
    assert r.status_code == 200
    drafted = [line for line in r.text.splitlines() if "draft" in line and not line.startswith("#")]
    assert drafted and any(float(line.split()[-1]) > 0 for line in drafted), r.text
