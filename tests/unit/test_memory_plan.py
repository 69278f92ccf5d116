"""Memory sized from what the machine has: table cases of devices and the models people run.

Configs are the published shapes (layer counts, KV heads, head sizes, sliding windows, layer
kinds); weights are their 4-bit sizes. The devices are described as MLX reports them
(``device_info()``), so the Metal and CUDA branches run here on a CPU.
"""

from __future__ import annotations

import pytest

from mlx_server.engine.core.scheduler import Scheduler
from mlx_server.errors import ContextLengthExceeded
from mlx_server.models.base import kv_bytes_per_token
from mlx_server.models.memory_plan import (
    GiB,
    KVShape,
    device_from_info,
    kv_shape,
    layer_kinds,
    plan_memory,
)

pytestmark = pytest.mark.tiny

MAC_16 = device_from_info(
    {"memory_size": 16 * GiB, "max_recommended_working_set_size": 11_453_251_584}, "metal", 0
)
MAC_128 = device_from_info(
    {"memory_size": 128 * GiB, "max_recommended_working_set_size": 96 * GiB}, "metal", 0
)
H200 = device_from_info({"total_memory": 150_754_820_096, "free_memory": 149 * GiB}, "cuda", 0)
LINUX_24 = device_from_info({}, "cpu", 24 * GiB)


def _dense(layers: int, kv_heads: int, head_dim: int, hidden: int, heads: int) -> dict:
    return {
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_size": hidden,
        "num_attention_heads": heads,
    }


LLAMA_32_3B = _dense(28, 8, 128, 3072, 24)
LLAMA_31_8B = _dense(32, 8, 128, 4096, 32)
QWEN3_8B = _dense(36, 8, 128, 4096, 32)
GEMMA3_4B = {  # a VLM config: the language model's fields under text_config
    "text_config": {
        **_dense(34, 4, 256, 2560, 8),
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
    }
}
QWEN35_9B = {  # three linear-attention (gated delta) layers to one full-attention layer
    **_dense(32, 4, 256, 4096, 16),
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    * 8,
}
GPT_OSS_20B = {
    **_dense(24, 8, 64, 2880, 64),
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
}

WEIGHTS_4BIT = {
    "llama-3.2-3b": (LLAMA_32_3B, int(1.8 * GiB)),
    "llama-3.1-8b": (LLAMA_31_8B, int(4.5 * GiB)),
    "qwen3-8b": (QWEN3_8B, int(4.6 * GiB)),
    "gemma-3-4b": (GEMMA3_4B, int(3.0 * GiB)),
    "qwen3.5-9b": (QWEN35_9B, int(5.3 * GiB)),
    "gpt-oss-20b": (GPT_OSS_20B, int(12.1 * GiB)),
}


def _plan(device, name: str, ctx: int = 32768):
    config, weights = WEIGHTS_4BIT[name]
    return plan_memory(device, weights, kv_shape(config, kv_bytes_per_token(config)), ctx)


def test_devices_are_read_from_each_backends_keys() -> None:
    assert (MAC_16.kind, MAC_16.usable) == ("metal", 11_453_251_584)
    # MLX's CUDA backend reports total_memory, not Metal's keys.
    assert (H200.kind, H200.usable) == ("cuda", 150_754_820_096)
    assert (LINUX_24.kind, LINUX_24.usable) == ("cpu", 18 * GiB)
    # A CUDA device that reports nothing falls back to the RAM, said as such.
    assert device_from_info({}, "cuda", 8 * GiB).kind == "cpu"


@pytest.mark.parametrize("name", ["llama-3.2-3b", "llama-3.1-8b", "qwen3-8b", "gemma-3-4b"])
def test_a_16gb_mac_serves_a_32k_chat(name: str) -> None:
    """A quarter of the working set (2.67 GiB) refused every 32k request of these; what is
    left after the weights holds at least one."""
    plan = _plan(MAC_16, name)
    assert plan.fits
    assert plan.longest_context >= 32768
    assert plan.full_context_requests >= 1
    assert plan.budget > MAC_16.usable // 4
    assert plan.budget + plan.weights + plan.margin == MAC_16.usable


def test_gpt_oss_20b_does_not_fit_a_16gb_mac_and_the_refusal_names_the_sizes() -> None:
    plan = _plan(MAC_16, "gpt-oss-20b")
    assert not plan.fits
    text = plan.refusal()
    assert "12.10 GiB" in text and "10.67 GiB" in text and "--kv-budget-gb" in text


def test_a_given_budget_is_taken_as_is() -> None:
    config, weights = WEIGHTS_4BIT["gpt-oss-20b"]
    kv = kv_shape(config, kv_bytes_per_token(config))
    plan = plan_memory(MAC_16, weights, kv, 8192, budget_override=2 * GiB)
    assert plan.fits and plan.budget == 2 * GiB and "--kv-budget-gb" in plan.line()


@pytest.mark.parametrize("device", [MAC_128, H200, LINUX_24], ids=["mac128", "h200", "linux24"])
@pytest.mark.parametrize("name", sorted(WEIGHTS_4BIT))
def test_larger_machines_hold_several_full_contexts(device, name: str) -> None:
    plan = _plan(device, name)
    assert plan.fits
    assert plan.full_context_requests >= 2
    assert plan.longest_context >= 32768


def test_layer_kinds_of_hybrid_and_sliding_families() -> None:
    assert layer_kinds(GEMMA3_4B).count("full") == 5  # layers 6, 12, 18, 24, 30
    assert layer_kinds(QWEN35_9B).count("recurrent") == 24
    assert layer_kinds(GPT_OSS_20B).count("sliding") == 12
    nemotron = {"num_hidden_layers": 6, "hybrid_override_pattern": "M-M*-E"}
    assert layer_kinds(nemotron) == ["recurrent", "recurrent", "full"]
    gemma4 = {"num_hidden_layers": 4, "num_kv_shared_layers": 2}
    assert layer_kinds(gemma4) == ["full", "full", "shared", "shared"]
    qwen_next = {"num_hidden_layers": 8, "full_attn_interval": 4}
    assert layer_kinds(qwen_next).count("full") == 2


def test_sliding_layers_cost_their_window_not_the_context() -> None:
    all_layers = kv_bytes_per_token(GEMMA3_4B)
    kv = kv_shape(GEMMA3_4B, all_layers)
    per_layer = all_layers // 34
    assert kv.per_token == 5 * per_layer
    assert kv.per_sequence == 29 * 1024 * per_layer
    # At 32k tokens the estimate is a fraction of counting every layer in full.
    assert kv.bytes_for(32768) < all_layers * 32768 // 3


def test_the_plan_line_states_budget_and_longest_context() -> None:
    plan = _plan(MAC_16, "llama-3.1-8b")
    line = plan.line()
    assert "budget" in line and "32768 tokens" in line and "full-context requests" in line


def _scheduler(budget: int, kv: KVShape) -> Scheduler:
    return Scheduler(
        max_batch_size=4,
        max_queue=4,
        prefill_step_size=512,
        kv_budget_bytes=budget,
        kv_bytes_per_token=kv.per_token,
        kv_bytes_per_sequence=kv.per_sequence,
        prefix_cache=None,
    )


def test_a_request_without_max_tokens_is_admitted_on_a_16gb_mac() -> None:
    """Llama-3.1-8B 4-bit at --ctx-size 32768: the request asks for the whole context."""
    import asyncio

    from mlx_server.engine.core.handle import GenerationHandle, Outbox
    from mlx_server.types import GenerationRequest

    plan = _plan(MAC_16, "llama-3.1-8b")
    sched = _scheduler(plan.budget, plan.kv)
    prompt = list(range(1000))
    req = GenerationRequest(request_id="r", prompt_tokens=prompt, max_tokens=32768 - 1000)
    loop = asyncio.new_event_loop()
    try:
        sched.queue(req, GenerationHandle("r", loop, Outbox()))
    finally:
        loop.close()
    assert len(sched.pending) == 1


def test_beyond_the_budget_is_a_context_overflow_jan_recognises() -> None:
    sched = _scheduler(1000 * 64, KVShape(64))
    from mlx_server.types import GenerationRequest

    req = GenerationRequest(request_id="r", prompt_tokens=list(range(900)), max_tokens=200)
    with pytest.raises(ContextLengthExceeded) as info:
        sched.queue(req, None)  # type: ignore[arg-type]
    assert "the request exceeds the available context size" in info.value.message
    assert info.value.n_ctx == 1000
