"""The idle-time warm-up's lone decode steps over longer key buffers (where kernels are built
per shape: on CUDA, MLX gives a one-token query over a slice of a 256-multiple key buffer to
cuDNN, a graph per buffer length). Each piece must meet the shape a lone answer meets, on
every model whose cache is plain KV layers (with recurrent states beside them), and none on
a model with other layers; the pieces come in idle time, the short buffers first."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from arch_models import FAMILIES, build
from mlx_lm import load

from mlx_server.boot import chat as boot_chat
from mlx_server.config import Settings
from mlx_server.engine.core import tuning, warming
from mlx_server.engine.core.config import EngineConfig
from mlx_server.engine.core.tuning import (
    COLD_FIRST_TOKEN_S,
    WarmUp,
    _lone_decode,
    lone_decode_lengths,
)
from mlx_server.engine.core.warming import Warming


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("lone")
    names = ("llama", "qwen3_5", "gemma3_text")
    return {n: load(str(build(n, root / n)))[0] for n in names}


def test_the_lengths_are_the_cache_steps_up_to_the_limit(models):
    assert lone_decode_lengths(models["llama"], 1000) == [256, 512, 768]
    assert lone_decode_lengths(models["llama"], 1024) == [256, 512, 768, 1024]
    assert lone_decode_lengths(models["qwen3_5"], 600) == [256, 512]  # gated delta beside KV
    assert lone_decode_lengths(models["llama"], 0) == []
    assert lone_decode_lengths(models["gemma3_text"], 1000) == []  # sliding windows: not these


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_a_piece_decodes_one_token_over_the_whole_buffer(models, name, monkeypatch):
    seen: list[tuple[int, int, int]] = []
    fused = mx.fast.scaled_dot_product_attention

    def spy(q: mx.array, k: mx.array, v: mx.array, **kw: Any) -> mx.array:
        seen.append((q.shape[2], k.shape[2], k.shape[0]))
        return fused(q, k, v, **kw)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)
    for _ in _lone_decode(models[name], 768):
        pass
    decode = [s for s in seen if s[0] == 1]
    assert decode, seen
    assert all(s == (1, 768, 1) for s in decode), decode  # one token over all 768, alone


def test_the_pieces_run_in_idle_time_short_buffers_first(models, monkeypatch):
    ran: list[Any] = []

    def lone(model: Any, n: int):
        ran.append(("lone", n))
        yield from ()

    def drain(self: WarmUp, prompts: list[list[int]], max_tokens: int):
        ran.append(("batch", len(prompts)))
        yield from ()

    monkeypatch.setattr(tuning, "_lone_decode", lone)
    monkeypatch.setattr(WarmUp, "_drain", drain)
    monkeypatch.setattr(tuning, "LONE_DECODE_EARLY", 512)
    plan = WarmUp(models["llama"], 3, 256, 30.0, lone_keys=1024)
    plan.before_ready()
    assert ran == [("batch", 1)]  # before the readiness line: batch size 1 alone
    while plan.pending:
        plan.step()
    assert ran[1:] == [
        ("lone", 256),
        ("lone", 512),
        ("batch", 2),
        ("batch", 3),
        ("batch", 1),  # a full prefill chunk
        ("lone", 768),
        ("lone", 1024),
    ]


def test_the_start_line_says_what_is_left(models, monkeypatch):
    lines: list[str] = []
    monkeypatch.setattr(warming, "log", lines.append)
    cfg = EngineConfig(max_batch_size=2, warm_up=True, prefill_step_size=256, lone_decode_keys=512)
    w = Warming(models["llama"], cfg)
    assert w.before_serving(30.0) == ""
    (line,) = [x for x in lines if x.startswith("Warm-up:")]
    assert line.endswith("batch sizes 2-2, a lone decode step over 256-512 keys"), line
    w.close()


def test_only_a_text_model_on_one_rank_where_kernels_are_built_per_shape(monkeypatch):
    settings = Settings(ctx_size=6000)
    assert boot_chat._lone_decode_keys(settings, False, None, 1 << 30, 1024) == 0  # this CPU
    monkeypatch.setattr(boot_chat, "builds_kernels_on_first_use", lambda: True)
    assert boot_chat._lone_decode_keys(settings, False, None, 1 << 30, 1024) == 6000
    assert boot_chat._lone_decode_keys(Settings(), False, None, 1 << 30, 1024) == 4096
    assert boot_chat._lone_decode_keys(Settings(ctx_size=32768), False, None, 1 << 40, 1) == 8192
    assert boot_chat._lone_decode_keys(settings, False, None, 3 << 20, 1024) == 3072  # KV budget
    assert boot_chat._lone_decode_keys(settings, True, None, 1 << 30, 1024) == 0  # a VLM
    assert boot_chat._lone_decode_keys(settings, False, object(), 1 << 30, 1024) == 0  # ranks


def test_the_readiness_waits_briefly_for_a_first_token_only_where_kernels_are_built(
    monkeypatch,
):
    assert boot_chat._ready_after(True) == float("inf")  # this CPU: the token in milliseconds
    monkeypatch.setattr(boot_chat, "builds_kernels_on_first_use", lambda: True)
    assert boot_chat._ready_after(True) == COLD_FIRST_TOKEN_S
    assert boot_chat._ready_after(False) == float("inf")  # a registry's load: no line to hurry


def test_the_tiny_model_generates_the_same_after_the_pieces(models):
    """A piece leaves nothing behind: the model's answer is the same before and after."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    model = models["llama"]

    def greedy() -> list[int]:
        prompt = mx.array([1, 2, 3, 4, 5])
        steps = generate_step(prompt, model, max_tokens=6, prompt_cache=make_prompt_cache(model))
        return [int(t) for t, _ in steps]

    before = greedy()
    for n in lone_decode_lengths(model, 512):
        for _ in _lone_decode(model, n):
            pass
    assert greedy() == before


def test_builds_nothing_by_default(tiny_model_dir: Path):
    model = load(str(tiny_model_dir))[0]
    assert WarmUp(model, 2, 256, 30.0).lone_lengths == []


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_runs_its_pieces_or_has_none(arch_model_dirs, name):
    """Every architecture: plain KV layers (with recurrent states beside them) get the pieces
    and run them; any other layer kind (a sliding window) gets none."""
    model = load(str(arch_model_dirs[name]))[0]
    lengths = lone_decode_lengths(model, 512)
    kinds = FAMILIES[name].caches
    if kinds <= {"KVCache", "ArraysCache", "MambaCache"} and "KVCache" in kinds:
        assert lengths == [256, 512]
    else:
        assert lengths == [], kinds
    for n in lengths:
        for _ in _lone_decode(model, n):
            pass


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_computes_its_first_token_and_a_decode_step(arch_model_dirs, name):
    """Before readiness: a prefill and one decode step on a fresh cache, on every
    architecture; the logits' dtype is what a request's sampler is checked in."""
    model = load(str(arch_model_dirs[name]))[0]
    calls: list[int] = []

    class Counting:
        def __getattr__(self, attr: str) -> Any:
            return getattr(model, attr)

        def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
            calls.append(inputs.shape[1])
            return model(inputs, cache=cache)

    dtype = tuning.first_token(Counting())
    assert calls == [2, 1]
    assert dtype == model(mx.array([[1]]))[:, -1, :].dtype
