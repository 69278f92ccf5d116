"""Vision requests in the continuous batch and the prefix cache, through the chat service
on the tiny Idefics3 (a Llama language model): requests with images and text-only ones
decode together, the same image in the next turn is served from the cache and a different
one is not, and cancelling one leaves the others running. And a tiny Gemma 3, whose
sliding-window layers need checkpoints."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from engine_runner import generate, request, until, vision_engine
from test_vision_engine import batched
from test_vision_service import ask, chat, image
from tiny_vlm import build_tiny_idefics3

from mlx_server.engine.core.engine import Engine, EngineConfig
from mlx_server.engine.runners.vision import VisionRunner
from mlx_server.engine.runners.vision_prefill import batch_refusal
from mlx_server.events import Finished, TextDelta
from mlx_server.models.loader import load_model
from mlx_server.models.media import MediaLimits
from mlx_server.models.vision import VisionPromptBuilder
from mlx_server.service import ChatService

RED, BLUE = (255, 0, 0), (0, 0, 255)


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> Any:
    loaded = load_model(str(build_tiny_idefics3(tmp_path_factory.mktemp("vlm") / "idefics3")))
    # gather_s: requests started together are admitted together (no wave depends on timing).
    config = EngineConfig(kv_bytes_per_token=256, gather_s=10.0)
    assert batch_refusal(loaded.model) == ""
    engine = vision_engine(loaded.model, loaded.tokenizer, config)
    vision = VisionPromptBuilder(loaded.processor, loaded.config, MediaLimits())
    svc = ChatService(loaded.model_id, loaded.tokenizer, engine, ctx_size=4096, vision=vision)
    engine.start()
    yield svc
    engine.shutdown(timeout=10)


async def finish(gen: Any) -> tuple[str, Finished]:
    text, final = "", None
    async for ev in gen.events():
        if isinstance(ev, TextDelta):
            text += ev.text
        elif isinstance(ev, Finished):
            final = ev
    assert final is not None
    return text, final


def run_all(service: ChatService, *reqs: Any) -> list[tuple[str, Finished]]:
    async def main():
        gens = await asyncio.gather(*(service.start(r) for r in reqs))
        return await asyncio.gather(*(finish(g) for g in gens))

    return asyncio.run(main())


def test_images_and_text_decode_in_one_batch(service):
    engine = service.engine
    before = engine.stats()["vision_prefills"]
    reqs = [
        chat(ask(image(RED)), max_tokens=12, ignore_eos=True),
        chat(ask(image(BLUE), text="And this one?"), max_tokens=12, ignore_eos=True),
        chat(ask(text="No picture today."), max_tokens=12, ignore_eos=True),
    ]
    results = run_all(service, *reqs)
    assert [f.reason for _, f in results] == ["length"] * 3
    assert [f.usage.completion_tokens for _, f in results] == [12] * 3
    stats = engine.stats()
    assert stats["mode"] == "batch"
    assert stats["vision_prefills"] == before + 2  # the text-only one took the text path
    assert stats["peak_batch"] >= 3  # all three decoded together
    # Batched, each request is what it is alone (greedy): the images reached the model.
    alone = run_all(service, reqs[0])[0]
    assert alone[0] == results[0][0] and results[0][0] != results[1][0]


def test_the_same_image_next_turn_is_cached_and_a_different_one_is_not(service):
    first = chat(ask(image((0, 120, 0)), text="Turn one."), max_tokens=6, ignore_eos=True)
    text, done = run_all(service, first)[0]
    n1 = done.usage.prompt_tokens
    assert done.usage.cached_tokens < 20  # at most the text before the image

    def turn_two(color):
        messages = [ask(image(color), text="Turn one."), {"role": "assistant", "content": text}]
        return chat(*messages, ask(text="Turn two."), max_tokens=4, ignore_eos=True)

    _, same = run_all(service, turn_two((0, 120, 0)))[0]
    assert same.usage.cached_tokens >= n1 - 1  # turn one's prompt (and answer) from the cache
    _, other = run_all(service, turn_two((120, 0, 120)))[0]
    # Only the text before the image: the image's tokens and all after them are prefilled.
    assert 0 < other.usage.cached_tokens < 20
    assert same.reason == other.reason == "length"


def test_a_system_prompt_before_an_image_is_kept_as_such(service):
    system = {"role": "system", "content": "You describe pictures for a blind reader. " * 8}
    before = service.engine.stats()["prompt_cache_system_entries"]
    _, first = run_all(service, chat(system, ask(image(RED)), max_tokens=2, ignore_eos=True))[0]
    assert service.engine.stats()["prompt_cache_system_entries"] == before + 1
    other = chat(system, ask(image(BLUE), text="Another."), max_tokens=2, ignore_eos=True)
    _, second = run_all(service, other)[0]
    assert second.usage.cached_tokens >= 60  # the system prompt, whichever entry serves it
    assert second.usage.cached_tokens < first.usage.prompt_tokens - 20  # not the image


def test_cancelling_one_leaves_the_others_running(service):
    engine = service.engine
    long = chat(ask(image(RED)), max_tokens=4000, ignore_eos=True)
    short = chat(ask(image(BLUE)), max_tokens=24, ignore_eos=True)

    async def main():
        g_long, g_short = await asyncio.gather(service.start(long), service.start(short))
        t_short = asyncio.ensure_future(finish(g_short))
        seen = []

        async def read_long():
            async for ev in g_long.events():
                if isinstance(ev, TextDelta):
                    seen.append(ev)
                if isinstance(ev, Finished):
                    return ev

        t_long = asyncio.ensure_future(read_long())
        await until(lambda: seen, "the long request's first tokens")
        assert engine.cancel(g_long.request_id) == 1
        return await t_long, await t_short

    f_long, (_, f_short) = asyncio.run(main())
    assert f_long.reason == "cancelled" and f_long.usage.completion_tokens < 4000
    assert f_short.reason == "length" and f_short.usage.completion_tokens == 24
    assert engine.active_count == 0


# ---- Gemma 3: sliding-window layers, checkpoints -------------------------------------------


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> Any:
    """A tiny Gemma 3 built in memory (SigLIP tower, 4 image tokens, a sliding window of 8
    tokens on every other layer), with the tests' tokenizer and hand-made inputs."""
    import mlx.core as mx
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlx_vlm.models import gemma3
    from tiny_vlm import SPECIALS, _tokenizer

    from mlx_server.models.base import settle_arrays

    path = tmp_path_factory.mktemp("gemma3")
    vocab = _tokenizer(
        path, [*SPECIALS, "<start_of_image>", "<image_soft_token>", "<end_of_image>"]
    )
    tok = load_tokenizer(path, eos_token_ids=[vocab["<|im_end|>"]])
    image = vocab["<image_soft_token>"]
    text = gemma3.TextConfig(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=4,
        head_dim=16,
        num_key_value_heads=2,
        vocab_size=max(len(vocab), 64),
        sliding_window=8,
        sliding_window_pattern=2,
        mm_tokens_per_image=4,
        query_pre_attn_scalar=16,
    )
    tower = gemma3.VisionConfig(
        model_type="siglip_vision_model",
        num_hidden_layers=1,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        patch_size=14,
        image_size=28,
    )
    mx.random.seed(0)
    config = gemma3.ModelConfig(
        text_config=text,
        vision_config=tower,
        model_type="gemma3",
        vocab_size=text.vocab_size,
        image_token_index=image,
        hidden_size=64,
    )
    model = gemma3.Model(config)
    head = model.language_model.lm_head
    head.weight = head.weight * 4  # sharper than random: the outputs depend on the input
    settle_arrays(model)
    ids = tok.encode("<|im_start|>user\n", add_special_tokens=False)
    ids += [vocab["<start_of_image>"], *[image] * 4, vocab["<end_of_image>"]]
    ids += tok.encode("What is this?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    pixels = [mx.random.normal((1, 3, 28, 28)) for _ in range(2)]
    mask = mx.ones((1, len(ids)), dtype=mx.int32)
    mx.eval(pixels, mask)  # made here, used on the engine threads

    def req(i: int, n: int = 5) -> Any:
        key = [-1 - i if t == image else t for t in ids]  # as media_key would, per picture
        inputs = {"pixel_values": pixels[i], "attention_mask": mask}
        return request(
            ids, n, vision_inputs=inputs, cache_tokens=key, ignore_eos=True, logprobs=True
        )

    return model, tok, req, tok.encode("<|im_start|>user\nHi<|im_end|>\n", add_special_tokens=False)


def test_gemma3_batched_as_mlx_vlm_gives_and_checkpointed(gemma):
    model, tok, req, text = gemma
    eos = sorted(tok.eos_token_ids)
    serial = Engine(
        model,
        tok,
        EngineConfig(kv_bytes_per_token=256, prompt_cache_size=0, max_batch_size=1, solo=False),
        runner=VisionRunner(model, eos, prefill_step_size=8),
    )
    assert batch_refusal(model) == ""
    engine = vision_engine(model, tok, EngineConfig(kv_bytes_per_token=256, prefill_step_size=8))
    serial.start()
    engine.start()
    try:
        alone = [asyncio.run(generate(serial, req(i))) for i in range(2)]
        together = batched(engine, [req(0), req(1), request(text, 5, ignore_eos=True)])
        again = asyncio.run(generate(engine, req(0)))
        assert engine.stats()["peak_batch"] == 3
    finally:
        serial.shutdown(timeout=10)
        engine.shutdown(timeout=10)
    for ours, theirs in zip(together[:2], alone, strict=True):  # chunks of 8, window 8
        assert [e.logprob for e in ours.logprobs] == pytest.approx(
            [e.logprob for e in theirs.logprobs], abs=1e-3
        )
    # The sliding-window cache cannot be rewound: the prompt's end was kept as a checkpoint.
    assert again.cached == len(req(0).prompt_tokens) - 1 and again.text == together[0].text


@pytest.mark.parametrize("where", ["chunk", "join"])
def test_a_failing_prefill_ends_its_request_alone(gemma, monkeypatch, where):
    """A chunk of one prompt's prefill raising (after its vision tower ran), or its joining
    the batch once prefilled, ends that request with the error; the requests beside it, with
    an image and without, finish in full."""
    from mlx_server.engine.runners.solo import LoneFirstRunner
    from mlx_server.engine.runners.vision_prefill import VisionPrefill

    model, tok, req, text = gemma
    bad, good, plain = req(1, 6), req(0, 6), request(text, 6, ignore_eos=True)
    assert len(bad.prompt_tokens) > 2 * 8  # two chunks at least: the second one fails
    step, insert, calls = VisionPrefill.step, LoneFirstRunner.insert, []

    def failing(self):
        if self.job.request.request_id == bad.request_id:
            calls.append(len(self.fed))
            if len(calls) == 2 and where == "chunk":
                raise RuntimeError("it broke")
        return step(self)

    def refusing(self, job):
        if job.request.request_id == bad.request_id:
            raise RuntimeError("it broke")
        return insert(self, job)

    config = EngineConfig(kv_bytes_per_token=256, prefill_step_size=8, prompt_cache_size=0)
    engine = vision_engine(model, tok, config)
    engine.start()
    try:
        monkeypatch.setattr(VisionPrefill, "step", failing)
        monkeypatch.setattr(LoneFirstRunner, "insert", refusing if where == "join" else insert)
        together = batched(engine, [good, bad, plain])
        monkeypatch.setattr(VisionPrefill, "step", step)
        monkeypatch.setattr(LoneFirstRunner, "insert", insert)
        alone = [asyncio.run(generate(engine, r)) for r in (req(0, 6), plain)]
        assert engine.active_count == 0
    finally:
        engine.shutdown(timeout=10)
    # The tower ran and a chunk went in before the failure (all of them, joining).
    assert calls[:2] == [0, 8] and (len(calls) == 2) == (where == "chunk")
    for ours, theirs in zip([together[0], together[2]], alone, strict=True):
        assert ours.finished.reason == "length" and ours.finished.usage.completion_tokens == 6
        assert ours.text == theirs.text
        assert [e.logprob for e in ours.logprobs] == pytest.approx(
            [e.logprob for e in theirs.logprobs], abs=1e-3
        )
    failed = together[1].finished
    what = "prefill failed" if where == "chunk" else "joining the batch failed"
    assert failed.reason == "error" and f"{what}: RuntimeError: it broke" in (failed.error or "")
