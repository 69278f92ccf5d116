"""What the server relies on in mlx-lm beyond its documented API. pyproject bounds mlx-lm to
the versions tested; when a new release changes one of these, this file says which."""

from __future__ import annotations

import inspect

import pytest


def test_the_installed_version_is_within_the_tested_bounds():
    from importlib.metadata import version

    major, minor, *_ = (int(x) for x in version("mlx-lm").split(".")[:2] + ["0"])
    assert (major, minor) == (0, 32), (
        f"mlx-lm {version('mlx-lm')} is untested: run this file and widen pyproject's bound"
    )


def test_lru_prompt_cache_internals_the_prefix_cache_extends():
    from mlx_lm.models.cache import LRUPromptCache

    cache = LRUPromptCache(4, 1 << 20)
    for name in ("_trie", "_lru", "_n_bytes", "max_size", "max_bytes"):
        assert hasattr(cache, name), f"LRUPromptCache lost {name}: PrefixCache needs it"
    for name in ("search", "get", "add", "pop", "pop_prefixes"):
        assert callable(getattr(cache._trie, name, None)), f"the prompt trie lost {name}()"
    order = LRUPromptCache.CacheOrder()
    assert set(order._lrus) >= {"assistant", "user", "system"}, "cache kinds changed"
    for name in ("push", "remove", "pop", "__len__"):
        assert callable(getattr(order, name, None)), f"CacheOrder lost {name}()"
    res = cache._trie.search("model", [1, 2, 3])
    for name in ("exact", "shorter", "longer", "common_prefix"):
        assert hasattr(res, name), f"the trie's search result lost {name}"


def test_tokenizer_inference_helpers():
    from mlx_lm import tokenizer_utils

    for name in ("_infer_thinking", "_infer_tool_parser"):
        fn = getattr(tokenizer_utils, name, None)
        assert callable(fn), f"mlx_lm.tokenizer_utils.{name} is gone: parsing/ imports it"
        assert len(inspect.signature(fn).parameters) >= 1


def test_batch_generator_surface_the_engine_drives():
    from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch

    params = inspect.signature(BatchGenerator.insert_segments).parameters
    for name in (
        "segments",
        "max_tokens",
        "caches",
        "all_tokens",
        "samplers",
        "logits_processors",
        "stop_sequences",
    ):
        assert name in params, f"BatchGenerator.insert_segments lost {name}="
    assert "return_prompt_caches" in inspect.signature(BatchGenerator.remove).parameters
    for name in ("extract_cache", "next", "close"):
        assert callable(getattr(BatchGenerator, name, None)), f"BatchGenerator lost {name}()"
    gen_fields = set(GenerationBatch.Response.__dataclass_fields__)
    assert gen_fields >= {"uid", "token", "logprobs", "finish_reason", "prompt_cache", "all_tokens"}
    prompt_fields = set(PromptProcessingBatch.Response.__dataclass_fields__)
    assert prompt_fields >= {"uid", "progress", "end_of_segment", "end_of_prompt"}


# Top-p, min-p and the draw are the server's own (their settings as arrays: samplers.py);
# top-k and the penalties' processors are mlx-lm's.
@pytest.mark.parametrize("name", ["apply_top_k", "make_logits_processors"])
def test_sampling_helpers(name):
    from mlx_lm import sample_utils

    assert callable(getattr(sample_utils, name, None)), f"mlx_lm.sample_utils.{name} is gone"


def _one_layer_llama():
    """A one-layer Llama of 32 tokens (random weights)."""
    from mlx_lm.models import llama

    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=16,
        num_hidden_layers=1,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=32,
        rms_norm_eps=1e-5,
    )
    return llama.Model(args)


def test_the_decode_batch_the_grammar_masks_wrap():
    """BatchRunner wraps the model of BatchGenerator's decode batch (``DecodeStep``): that
    batch must be one object for the generator's life, call ``self.model(inputs[:, None],
    cache=...)`` each step with the tokens fed, sample from what it returns, and keep
    ``uids`` and a per-row ``logits_processors`` list in row order."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator, GenerationBatch

    model = _one_layer_llama()
    gen = BatchGenerator(model)  # no stop tokens: each sequence runs to max_tokens
    decode = gen._generation_batch
    assert isinstance(decode, GenerationBatch)
    calls: list[tuple[tuple[int, ...], list[int], int]] = []

    def forced(inputs: mx.array, cache: object = None) -> mx.array:
        logits = model(inputs, cache=cache)
        calls.append((tuple(inputs.shape), list(decode.uids), len(decode.logits_processors)))
        return mx.where(mx.arange(32) == 7, 0.0, -mx.inf) + mx.zeros_like(logits)

    decode.model = forced
    seen = []
    uids = gen.insert([[1, 2, 3], [4, 5]], max_tokens=[4, 4], logits_processors=[[], []])
    for _ in range(8):
        seen += [(r.uid, r.token) for r in gen.next()[1]]
        assert gen._generation_batch is decode
    assert calls and all(shape == (2, 1) for shape, _, _ in calls)
    assert all(order == uids and n == 2 for _, order, n in calls)
    # The first token comes from the batch mlx-lm makes after the prefill (its own model);
    # every later one from the decode batch's model.
    assert len(seen) == 8
    assert [t for _, t in seen[2:]] == [7] * 6


def test_a_new_group_s_first_step_the_first_step_masks_wrap():
    """``batch_step.mask_first_steps``: the generator's prompt batch is ``_prompt_batch``; a
    group split off it keeps its class (``split`` copies by class); its ``generate`` (tokens
    of one each) builds a ``GenerationBatch`` with ``self.model`` and the same ``uids`` and
    ``logits_processors`` list objects, and steps it once there, calling the model with the
    group's last tokens."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch

    model = _one_layer_llama()
    seen: list[tuple[int, ...]] = []

    class Marked(PromptProcessingBatch):
        def generate(self, tokens):
            lists = (self.uids, self.logits_processors)
            raw = self.model

            def first(inputs: mx.array, cache: object = None) -> mx.array:
                seen.append(tuple(inputs.shape))
                return raw(inputs, cache=cache)

            self.model = first
            batch = super().generate(tokens)
            assert isinstance(batch, GenerationBatch) and batch.model is first
            assert batch.uids is lists[0] and batch.logits_processors is lists[1]
            return batch

    gen = BatchGenerator(model)
    assert type(gen._prompt_batch) is PromptProcessingBatch
    gen._prompt_batch.__class__ = Marked
    gen.insert([[1, 2, 3], [4, 5]], max_tokens=[3, 3], logits_processors=[[], []])
    firsts = []
    for _ in range(6):
        firsts += [r.uid for r in gen.next()[1]]
        assert type(gen._prompt_batch) is Marked
    assert seen == [(2, 1)]  # one first step, for the group, inside generate
    assert len(firsts) == 6


TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 32,
    "num_hidden_layers": 3,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 50,
    "tie_word_embeddings": True,
}


def test_llama_internals_the_pipeline_rewires():
    """models/llama_pipeline.py keeps a rank's layers of ``LlamaModel`` and rebuilds its
    mask indices; sharding.py uses mlx-lm's own pipeline where a model has one."""
    from mlx_lm.models import llama
    from mlx_lm.models.pipeline import PipelineMixin

    model = llama.Model(llama.ModelArgs.from_dict(TINY_LLAMA))
    for name in ("layers", "fa_idx", "swa_idx", "embed_tokens", "norm"):
        assert hasattr(model.model, name), f"LlamaModel lost {name}"
    assert hasattr(model.model.layers[0], "use_sliding"), "TransformerBlock lost use_sliding"
    params = list(inspect.signature(llama.TransformerBlock.__call__).parameters)
    assert params[1:4] == ["x", "mask", "cache"], "a layer's call changed"
    assert callable(getattr(model, "shard", None)), "Llama lost tensor parallelism"
    assert not hasattr(model.model, "pipeline"), (
        "mlx-lm pipelines Llama now: sharding.py will use it; llama_pipeline may go"
    )
    assert callable(getattr(PipelineMixin, "pipeline", None))


def test_batch_generator_samples_shared_samplers_in_one_call():
    """engine/lockstep/samplers.py: every rank must make the same sampler calls, so it
    mirrors the sharing of sampler objects that BatchGenerator batches by."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models import llama

    model = llama.Model(llama.ModelArgs.from_dict(TINY_LLAMA))
    calls: list[tuple[str, int]] = []

    def sampler(name: str):
        def sample(logprobs: mx.array) -> mx.array:
            calls.append((name, logprobs.shape[0]))
            return mx.argmax(logprobs, axis=-1)

        return sample

    shared, own = sampler("shared"), sampler("own")
    gen = BatchGenerator(model, completion_batch_size=4, prefill_batch_size=4, stop_tokens=[])
    try:
        gen.insert([[1, 2, 3], [4, 5, 6]], max_tokens=[8, 8], samplers=[shared, shared])
        for _ in range(3):
            gen.next()
        assert ("shared", 2) in calls and ("shared", 1) not in calls
        calls.clear()
        gen.insert([[7, 8, 9]], max_tokens=[4], samplers=[own])
        for _ in range(3):
            gen.next()
        assert ("own", 1) in calls and ("shared", 1) in calls
    finally:
        gen.close()


def test_the_decode_batch_state_speculation_steps_and_the_batched_cache_it_rolls_back():
    """``speculative/batch.py`` turns the decode batch into a subclass in place and, in a
    verifying step, reads and sets its state between steps (the tokens in each row's cache,
    the pending sampled tokens and their log-probabilities, the per-row counters, stop
    matchers and processors' token buffers); ``batch_verify.py`` rolls rows back with
    ``BatchKVCache``'s trim and its right-padding roll (``prepare``/``finalize``)."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator, GenerationBatch
    from mlx_lm.models import llama
    from mlx_lm.models.cache import BatchKVCache, TokenBuffer

    model = llama.Model(llama.ModelArgs.from_dict(TINY_LLAMA))
    gen = BatchGenerator(model)
    decode = gen._generation_batch
    gen.insert([[1, 2, 3], [4, 5]], max_tokens=[8, 8])
    for _ in range(3):  # prefill, then decoding
        gen.next()
    assert gen._generation_batch is decode and len(decode.uids) == 2
    for name in (
        "uids", "tokens", "prompt_cache", "model", "samplers", "fallback_sampler",
        "logits_processors", "max_tokens", "_next_tokens", "_next_logprobs",
        "_current_tokens", "_current_logprobs", "_token_context", "_num_tokens", "_matchers",
    ):  # fmt: skip
        assert hasattr(decode, name), f"GenerationBatch lost {name}"
    assert decode._next_tokens.shape == (2,) and len(decode._next_logprobs) == 2
    for i, tokens in enumerate(decode.tokens):  # what each row's cache holds
        assert decode.extract_cache(i)[0].offset == len(tokens) > 2
    assert all(hasattr(m, "advance") for m in decode._matchers)
    assert isinstance(decode._token_context[0], TokenBuffer)
    for name in ("filter", "extract_cache", "extend"):
        assert callable(getattr(GenerationBatch, name, None)), f"GenerationBatch lost {name}()"
    assert set(GenerationBatch.Response.__dataclass_fields__) >= {"uid", "token", "logprobs"}

    class Sub(GenerationBatch):
        pass

    decode.__class__ = Sub  # no __slots__: the class can change in place
    cache = decode.prompt_cache[0]
    assert type(cache) is BatchKVCache
    for name in ("trim", "prepare", "finalize", "filter", "extract"):
        assert callable(getattr(cache, name, None)), f"BatchKVCache lost {name}()"
    before = cache.offset.tolist()
    cache.trim(1)
    cache.prepare(right_padding=[1, 0])
    cache.finalize()
    assert cache.offset.tolist() == [before[0] - 2, before[1] - 1]
    assert mx.array(cache.left_padding).shape == (2,)


def test_batch_generator_keeps_the_wired_limit_it_replaced_in_old_wired_limit():
    """engine/core/wired.py stops each BatchGenerator from restoring the limit it found by clearing
    ``_old_wired_limit``; ``close()`` must then leave the limit alone."""
    import inspect

    from mlx_lm.generate import BatchGenerator

    assert "self._old_wired_limit = maybe_set_recommended_wired_limit()" in inspect.getsource(
        BatchGenerator.__init__
    )
    close = inspect.getsource(BatchGenerator.close)
    assert "if self._old_wired_limit is not None:" in close


def test_gated_delta_update_the_cuda_kernel_stands_in_for():
    """models/gated_delta_cuda.py replaces ``gated_delta_update`` by name in the modules that
    call it, with the same parameters and mlx-lm's own gate helpers."""
    from mlx_lm.models import gated_delta, qwen3_5, qwen3_next

    names = list(inspect.signature(gated_delta.gated_delta_update).parameters)
    assert names == ["q", "k", "v", "a", "b", "A_log", "dt_bias", "state", "mask",
                     "use_kernel", "lower_bound", "allow_neg_eigval"]  # fmt: skip
    for name in ("compute_g", "compute_lower_bound_g", "gated_delta_ops"):
        assert callable(getattr(gated_delta, name, None)), f"gated_delta lost {name}()"
    for module in (qwen3_5, qwen3_next):
        assert module.gated_delta_update is gated_delta.gated_delta_update, module.__name__
