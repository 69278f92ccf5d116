"""The runner for vision-language models: the text engine runs it as any other runner.

Where the model allows it, vision requests share the continuous batch and the prefix cache
with text-only ones (``vision_batch.VisionBatchRunner``: the prompt with media is prefilled
through the vision tower, the language model decodes in the batch). A family not checked
to decode from tokens and a KV cache alone (Llama 3.2 Vision's cross-attention, ...), or
checked and found not to (LLaVA-NeXT's anyres features, Gemma 3n's prompt embeddings:
``vision_prefill.REFUSED_FAMILIES``), runs on ``VisionRunner``:
mlx-vlm's ``generate_step``, one request at a time, FIFO, without the prefix cache.
Everything else — the public API, queue limits, KV-budget admission, cancellation, stop
strings, logprobs, ``ignore_eos``, and the Usage/Timings in ``Finished`` — is the text
engine's.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx

from mlx_server.engine.core.config import EngineConfig
from mlx_server.engine.runners.assembly import batch_settings, eos_ids
from mlx_server.engine.runners.base import Insert, KVState, Progress, Response, Runner
from mlx_server.engine.runners.vision_batch import VisionBatchRunner
from mlx_server.engine.runners.vision_memory import media_bytes
from mlx_server.engine.runners.vision_prefill import batch_refusal
from mlx_server.logs import log


class VisionRunner:
    """One mlx-vlm ``generate_step`` at a time; each ``step`` reads one token of it."""

    def __init__(self, model: Any, eos: list[int], *, prefill_step_size: int):
        self.model = model
        self._eos = set(eos)
        self._step_size = prefill_step_size
        self._steps: Generator[tuple[Any, mx.array], None, None] | None = None
        self._uid = -1
        self._n = 0
        self._max_tokens = 0
        self._stop_ids: set[int] = set()

    def insert(self, job: Insert) -> None:
        from mlx_vlm.generate import generate_step

        if self._steps is not None:
            raise RuntimeError("the vision runner runs one request at a time")
        req = job.request
        inputs = dict(req.vision_inputs or {})
        pixel_values = inputs.pop("pixel_values", None)
        mask = inputs.pop("attention_mask", None)
        self._steps = generate_step(
            mx.array([job.prompt]),
            self.model,
            pixel_values,
            mask,
            max_tokens=req.max_tokens,
            sampler=job.sampler,
            logits_processors=job.processors or None,
            prefill_step_size=self._step_size,
            **inputs,
        )
        self._uid, self._n, self._max_tokens = job.uid, 0, req.max_tokens
        # ignore_eos: the engine masks the end-of-sequence tokens; none ends the request.
        self._stop_ids = set() if req.ignore_eos else self._eos

    def step(self) -> tuple[list[Progress], list[Response]]:
        if self._steps is None:
            return [], []
        try:
            token, logprobs = next(self._steps)
        except StopIteration:  # it yields max_tokens tokens; the last one ended it above
            self.close()
            raise RuntimeError("mlx-vlm's generate_step ended early") from None
        self._n += 1
        tok = int(token)
        finish = None
        if tok in self._stop_ids:
            finish = "stop"
        elif self._n >= self._max_tokens:
            finish = "length"
        if finish is not None:
            self.close()
        return [], [Response(self._uid, tok, logprobs, finish)]

    def remove(self, uids: list[int]) -> dict[int, KVState]:
        if self._uid in uids:
            self.close()
        return {}  # no prefix cache: a cached prefix would have to carry the image features

    def extract_state(self, uids: list[int]) -> dict[int, KVState]:
        return {}

    def reset(self) -> None:
        self.close()

    def close(self) -> None:
        if self._steps is not None:
            self._steps.close()
            self._steps = None
            mx.clear_cache()

    def stats(self) -> dict[str, Any]:
        return {"mode": "sequential"}


@dataclass(frozen=True)
class VisionSetup:
    """What start-up hands the engine for a vision model: the runner, the model the engine
    sees (batched: the language model, whose cache kinds decide checkpoints), the settings
    it runs under, and why requests run one at a time ("" when they batch)."""

    runner: Runner
    model: Any
    config: EngineConfig
    serial_reason: str


def vision_runner(model: Any, tokenizer: Any, config: EngineConfig | None = None) -> VisionSetup:
    """Requests share the continuous batch and the prefix cache
    (``vision_batch.VisionBatchRunner``) where the model allows it
    (``vision_prefill.batch_refusal``), else run one at a time, FIFO (``VisionRunner``).
    Batched, the config's warm-up and prefill buckets hold for the language model (what
    text-only requests and the text after a cached image meet: on CUDA a shape met first by
    a request costs it seconds); one at a time, there is no warm-up."""
    config = replace(config or EngineConfig(), media_bytes=media_bytes(model))
    eos = eos_ids(tokenizer)
    serial_reason = batch_refusal(model)
    if serial_reason:
        log(f"Vision requests run one at a time: {serial_reason}")
        config = replace(config, prompt_cache_size=0, max_batch_size=1, solo=False)
        config = replace(config, warm_up=False, prefill_buckets=False)
        runner = VisionRunner(model, eos, prefill_step_size=config.prefill_step_size)
        return VisionSetup(runner, model, config, serial_reason)
    batch = VisionBatchRunner(
        model,
        eos,
        solo=config.solo,
        prefill_buckets=config.prefill_buckets,
        **batch_settings(config),
    )
    return VisionSetup(batch, batch.lm, config, "")
