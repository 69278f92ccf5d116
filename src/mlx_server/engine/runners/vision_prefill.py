"""A vision request's prefill, so that its decoding can join the text batch.

A vision-language model is a vision tower in front of a language model: once the prompt's
image positions hold the tower's features (mlx-vlm's ``get_input_embeddings``), the rest is
the language model's alone. So a prompt with images is prefilled here — the tower and the
language model over the prompt's embeddings, in chunks, into a KV cache of its own — and
the sequence then goes on as a prefix-cache hit of a text prompt would: its cache, the
tokens in it, and the last prompt token still to feed (a chat prompt ends with the
assistant's header, which is text), on the text path's runners (``vision_batch``).
Decoding is the language model's, batched with every other sequence, text-only or not.

``LanguageModel`` is what the batch runs: mlx-vlm's language model behind the call mlx-lm
makes (``model(tokens, cache=...)`` answering logits), on mlx-lm's cache classes, which the
prefix cache, its disk tier and the batch's merging know.

Qwen-VL's multimodal rotary positions ride on each sequence's cache (``cache/mrope.py``).
Gemma 4's per-layer inputs (E2B/E4B) come with the prompt's embeddings, the image's
computed with its tokens masked: each chunk takes its rows, and decode steps compute them
from the tokens, as mlx-vlm's do; its KV-shared layers keep no cache of their own (the
cache list is shorter than the layers, as mlx-lm's batch takes it). Where mlx-vlm's
generate prefills a prompt in one piece (its model's ``chunked_prefill_policy``: Gemma 4
26B-A4B and 31B with images, whose tokens see each other through a mask made for a piece
that starts at 0), so does the prefill here, from the prompt's start. Gemma 4 unified (the
12B) is Gemma 4's language model behind an encoder-free patch embedder, its image tokens
seeing each other: the same path (its model's policy answers from the prompt's token types,
here as in mlx-vlm's generate, before the language model's, which would read the
``no_chunked_prefill`` its ``get_input_embeddings`` leaves on it for the last prompt).
Families not checked to decode from tokens and a cache alone (cross-attention to the image
in Llama 3.2 Vision, ...), and those checked and found not to (``REFUSED_FAMILIES``:
LLaVA-NeXT's image features longer than its image tokens, Gemma 3n's prompt embeddings
scaled unlike its decode steps') run one request at a time (``batch_refusal`` says why).
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models import cache as lm_cache

from mlx_server.engine.cache.mrope import (
    MROPE_FAMILIES,
    DeltaKVCache,
    first_int,
    positions,
    set_delta,
    starts,
)
from mlx_server.engine.runners.base import Insert, Progress
from mlx_server.models import mrope_text

# Outputs of ``get_input_embeddings`` that only the prefill uses (Gemma 3's mask letting an
# image's tokens see each other; Qwen-VL's positions, see cache/mrope.py). Any other would
# mean decode steps need it too.
_PREFILL_ONLY = {"inputs_embeds", "attention_mask_4d", "position_ids", "rope_deltas"}
# Qwen3-VL's deepstack: the tower's features of earlier layers, added to the first layers'
# hidden states at the image tokens; mlx-vlm's language model finds a chunk's share of them
# from the cache's offset.
_PREFILL_ONLY |= {"visual_pos_masks", "deepstack_visual_embeds"}
# Outputs with a row per prompt position, which a chunk takes its rows of: Gemma 4's
# per-layer inputs (E2B/E4B; decode steps compute them from the tokens).
_PER_TOKEN = {"per_layer_inputs"}
# The processor's token types (Gemma 4: which tokens are an image's), for the attention
# mask of a prompt prefilled in one piece (``VisionPrefill._chunked``), as mlx-vlm passes them.
_TOKEN_TYPES = ("mm_token_type_ids", "token_type_ids")
# The families whose language model decodes from tokens and a KV cache alone (checked with
# tiny models, or the same language model as one that is): others run one at a time
# (``REFUSED_FAMILIES``: those checked and found not to).
BATCHED_FAMILIES = {
    "idefics3",
    "smolvlm",
    "llava",
    "mistral3",
    "pixtral",
    "gemma3",
    "gemma4",
    "gemma4_unified",
    *MROPE_FAMILIES,
}


class LanguageModel:
    """mlx-vlm's language model as mlx-lm's batch calls a model; see the module docstring."""

    def __init__(self, vlm: Any):
        self.vlm = vlm
        self.lm = vlm.language_model
        self.mrope = family(vlm) in MROPE_FAMILIES  # positions from the caches' deltas
        # text positions rotate as plain RoPE, in one operation (models/mrope_text.py)
        self.text_ropes = mrope_text.install(self.lm.layers) if self.mrope else []

    def __call__(self, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        if self.mrope and cache is not None and "position_ids" not in kwargs:
            kwargs["position_ids"] = positions(cache, inputs.shape[1])
            with mrope_text.at(self.text_ropes, starts(cache)):
                out = self.lm(inputs, cache=cache, **kwargs)
        else:
            out = self.lm(inputs, cache=cache, **kwargs)
        return getattr(out, "logits", out)

    @property
    def layers(self) -> Any:
        return self.lm.layers

    def make_cache(self) -> list[Any]:
        """The language model's cache layers as mlx-lm's classes (same kinds and sizes)."""
        if self.mrope:
            return [DeltaKVCache() for _ in self.lm.layers]
        make = getattr(self.lm, "make_cache", None)
        if make is None:
            return [lm_cache.KVCache() for _ in self.lm.layers]
        return [_as_mlx_lm(c) for c in make()]

    def rope_delta(self, job: Insert) -> int:
        """A Qwen-VL prompt's position delta (0 without media)."""
        inputs = job.request.vision_inputs or {}
        if not self.mrope or "pixel_values" not in inputs and "video_grid_thw" not in inputs:
            return 0
        _, delta = self.lm.get_rope_index(
            mx.array([job.prompt]),
            inputs.get("image_grid_thw"),
            inputs.get("video_grid_thw"),
            inputs.get("attention_mask"),
        )
        return first_int(delta)

    def __getattr__(self, name: str) -> Any:
        if name in ("vlm", "lm", "mrope", "text_ropes"):  # not set yet
            raise AttributeError(name)
        return getattr(self.lm, name)


def _as_mlx_lm(c: Any) -> Any:
    kind = type(c).__name__
    if kind == "KVCache":
        return lm_cache.KVCache()
    if kind == "RotatingKVCache":
        return lm_cache.RotatingKVCache(max_size=c.max_size, keep=getattr(c, "keep", 0))
    raise ValueError(f"its language model's {kind} layers are not batched here")


def family(vlm: Any) -> str:
    return str(getattr(getattr(vlm, "config", None), "model_type", "") or "")


# Families checked and found not to batch as mlx-vlm runs them alone, and why.
REFUSED_FAMILIES = {
    # mlx_vlm/models/llava_next/processing_llava_next.py:157-175 expands "<image>" into the
    # anyres feature count (13 tokens for a 40x60 image in 28-pixel tiles, measured), and
    # llava_next.py:86-123 puts a whole tile's features (or a newline block) at each of
    # them: 58 embeddings for a prompt of 31 tokens.
    "llava_next": "mlx-vlm gives its prompts more image embeddings than image tokens (a "
    "tile's features at each), and the batch feeds one embedding per token",
    # mlx_vlm/models/gemma3n/gemma3n.py:122 embeds a prompt's tokens without the
    # sqrt(hidden_size) scale that language.py:479 gives tokens fed as ids (decode steps,
    # and in the batch a prompt's last token, text-only prompts, the text after a cached
    # image); Hugging Face's scales both. Its KV-shared layers also read ``cache.state``
    # (language.py:136), the whole buffer on mlx-lm's caches.
    "gemma3n": "mlx-vlm embeds its prompts without the scale its language model gives "
    "tokens fed as ids, which the batch feeds a prompt's last token as",
}


def batch_refusal(vlm: Any) -> str:
    """Why this vision model's requests cannot share the batch ("" when they can)."""
    lm = getattr(vlm, "language_model", None)
    if lm is None:
        return "it has no separate language model"
    name = family(vlm)
    if name in REFUSED_FAMILIES:
        return f"{name} models are not batched: {REFUSED_FAMILIES[name]}"
    if name not in BATCHED_FAMILIES:
        return f"{name or 'this'} models are not batched yet"
    try:
        LanguageModel(vlm).make_cache()
    except ValueError as e:
        return str(e)
    return ""


class VisionPrefill:
    """One prompt with media fed into its own KV cache, a chunk per ``step``; everything but
    the last token (the batch feeds it, and samples from its logits). The vision tower runs
    as it is made, so that media the model cannot take fail their own request only."""

    def __init__(self, vlm: Any, lm: LanguageModel, job: Insert, *, prefill_step_size: int):
        self.job = job
        self.uid = job.uid
        self._vlm = vlm
        self.cache = job.cache if job.cache is not None else lm.make_cache()
        self.fed = list(job.prompt[: job.cached])
        self._prompt = job.prompt
        self._end = len(job.prompt) - 1  # the last token is the batch's
        self._step_size = prefill_step_size
        # Where the engine keeps states: the system prompt's end, checkpoints (job.pauses).
        self._pauses = [p for p in job.pauses if p < self._end]
        self._embeds: mx.array | None = None
        self._extra: dict[str, Any] = {}
        self._per_token: dict[str, mx.array] = {}
        self._positions: mx.array | None = None
        self.delta = 0
        with mx.stream(generation_stream):
            self._embed()  # here, so that a failure is this request's (at its start)
            if not self._chunked():
                # As mlx-vlm's generate: the prompt in one piece, without pauses, from its
                # start. A cached prefix is set aside: after it, Gemma 4's mask would not let
                # an image's tokens see each other (it does so for a piece from 0 alone).
                self.cache = lm.make_cache() if self.fed else self.cache
                self.fed, self._pauses, self._step_size = [], [], max(self._end, 1)
                given = self.job.request.vision_inputs or {}
                types = {k: mx.array(given[k]) for k in _TOKEN_TYPES if k in given}
                self._per_token.update(types)

    @property
    def done(self) -> bool:
        return len(self.fed) >= self._end

    def step(self) -> Progress:
        """Feed one chunk of the prompt's embeddings."""
        with mx.stream(generation_stream):
            start = len(self.fed)
            stop = min(self._end, start + self._step_size)
            stop = min([stop, *(p for p in self._pauses if p > start)])
            assert self._embeds is not None
            extra = dict(self._extra)
            if self._positions is not None:
                extra["position_ids"] = self._positions[..., start:stop]
            extra.update({k: v[:, start:stop] for k, v in self._per_token.items()})
            self._vlm.language_model(  # (never empty: media lie before the last token)
                inputs=mx.array([self._prompt[start:stop]]),
                inputs_embeds=self._embeds[:, start:stop],
                cache=self.cache,
                n_to_process=stop - start,
                **extra,
            )
            mx.eval([c.state for c in self.cache])
        self.fed = list(self._prompt[:stop])
        if self.done:
            self._embeds, self._extra, self._positions = None, {}, None
            self._per_token = {}
            set_delta(self.cache, self.delta)  # where the text after the media goes on
        mx.clear_cache()
        total = self._end + 1 - self.job.cached
        # Segments end at the pauses and at the prompt's end (a checkpoint where the cache
        # cannot be rewound), as in the batch: the engine keeps the states there.
        ends = self.done or stop in self._pauses
        return Progress(self.uid, (stop - self.job.cached, total), end_of_segment=ends)

    def _embed(self) -> None:
        inputs = dict(self.job.request.vision_inputs or {})
        pixel_values = inputs.pop("pixel_values", None)
        mask = inputs.pop("attention_mask", None)
        out = self._vlm.get_input_embeddings(
            mx.array([self._prompt]), pixel_values, mask=mask, **inputs
        )
        extra = {k: v for k, v in out.to_dict().items() if v is not None}
        length = out.inputs_embeds.shape[1]
        if length != len(self._prompt):
            # The batch feeds tokens: one embedding each (LLaVA-NeXT's anyres is not so).
            raise ValueError(
                f"this model's image features give {length} embeddings for a prompt of "
                f"{len(self._prompt)} tokens; its requests cannot share the batch"
            )
        needs = sorted(set(extra) - _PREFILL_ONLY - _PER_TOKEN)
        if needs:
            raise ValueError(f"this model's images need {', '.join(needs)} at every step")
        extra.pop("inputs_embeds")
        self._positions = extra.pop("position_ids", None)  # Qwen-VL: (3, 1, length)
        delta = extra.pop("rope_deltas", None)
        self.delta = 0 if delta is None else first_int(delta)
        self._per_token = {k: extra.pop(k) for k in _PER_TOKEN if k in extra}
        self._embeds = out.inputs_embeds
        self._extra = extra
        mx.eval(self._embeds, self._per_token)

    def _chunked(self) -> bool:
        """Whether mlx-vlm's generate prefills this prompt in chunks, as its model's
        ``chunked_prefill_policy`` (or ``no_chunked_prefill``) says. Gemma 4 with
        ``use_bidirectional_attention="vision"`` (26B-A4B, 31B) says no to a prompt with images:
        an image's tokens see each other, which its mask lets them do only in a piece that
        starts at 0 (mlx_vlm/models/gemma4/language.py, ``chunked_prefill_policy`` and
        ``_apply_blockwise_bidirectional_overlay``, which leaves a mask that is not square
        as it is)."""
        assert self._embeds is not None
        inputs = self.job.request.vision_inputs or {}
        models = [self._vlm, self._vlm.language_model]
        for m in models:
            policy = getattr(m, "chunked_prefill_policy", None)
            if callable(policy):
                answer = policy(
                    input_ids=mx.array([self._prompt]),
                    inputs_embeds=self._embeds,
                    prompt_cache=self.cache,
                    draft_model=None,
                    draft_kind=None,
                    prefill_kwargs={**inputs, **self._extra, **self._per_token},
                )
                return bool(getattr(answer, "enabled", answer))
        return not any(getattr(m, "no_chunked_prefill", False) for m in models)

    def state(self, copied: bool) -> tuple[Any, list[int]]:
        """The KV state so far and the tokens in it."""
        return (copy.deepcopy(self.cache) if copied else self.cache), list(self.fed)
