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
Families not checked to decode from tokens and a cache alone (cross-attention to the image
in Llama 3.2 Vision, Gemma 3n's per-layer inputs, LLaVA-NeXT's image features longer than
its image tokens) run one request at a time (``batch_refusal`` says why).
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
# The families whose language model decodes from tokens and a KV cache alone (checked with
# tiny models, or the same language model as one that is): others run one at a time.
# LLaVA-NeXT is not among them: its image features (tiles and newline rows) replace a
# single placeholder, so its embeddings are longer than its tokens.
BATCHED_FAMILIES = {
    "idefics3",
    "smolvlm",
    "llava",
    "mistral3",
    "pixtral",
    "gemma3",
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


def batch_refusal(vlm: Any) -> str:
    """Why this vision model's requests cannot share the batch ("" when they can)."""
    lm = getattr(vlm, "language_model", None)
    if lm is None:
        return "it has no separate language model"
    if family(vlm) not in BATCHED_FAMILIES:
        return f"{family(vlm) or 'this'} models are not batched yet"
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
        self._positions: mx.array | None = None
        self.delta = 0
        with mx.stream(generation_stream):
            self._embed()  # here, so that a failure is this request's (at its start)

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
        needs = sorted(set(extra) - _PREFILL_ONLY)
        if needs:
            raise ValueError(f"this model's images need {', '.join(needs)} at every step")
        extra.pop("inputs_embeds")
        self._positions = extra.pop("position_ids", None)  # Qwen-VL: (3, 1, length)
        delta = extra.pop("rope_deltas", None)
        self.delta = 0 if delta is None else first_int(delta)
        self._embeds = out.inputs_embeds
        self._extra = extra
        mx.eval(self._embeds)

    def state(self, copied: bool) -> tuple[Any, list[int]]:
        """The KV state so far and the tokens in it."""
        return (copy.deepcopy(self.cache) if copied else self.cache), list(self.fed)
