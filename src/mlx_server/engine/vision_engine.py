"""The engine for vision-language models: one request at a time with mlx-vlm's generate_step.

mlx-lm's BatchGenerator takes token ids only; a vision model's first step also needs the
pixels (and, for Qwen-VL, grid sizes and multimodal positions), which mlx-vlm's
``generate_step`` feeds through the model's ``get_input_embeddings``. Requests therefore
run one after another, FIFO, in the engine's owner thread. Everything else — the public
API, queue limits, KV-budget admission, cancellation, stop strings, logprobs, and the
Usage/Timings in ``Finished`` — is the text engine's, inherited from ``Engine``.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx

from mlx_server.engine.engine import Engine, EngineConfig, _Seq
from mlx_server.engine.handle import Started
from mlx_server.engine.sampling import make_processors, make_sampler, mask_tokens
from mlx_server.parsing.stops import StopMatcher


@dataclass(frozen=True)
class _Step:
    """One generated token, shaped like a BatchGenerator response for ``_on_token``."""

    token: int
    logprobs: mx.array
    finish_reason: str | None


class VisionEngine(Engine):
    """Serves an mlx-vlm model, one request at a time; the same interface as ``Engine``."""

    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig | None = None):
        # No prefix cache: a cached prefix would have to carry the image features with it.
        super().__init__(model, tokenizer, replace(config or EngineConfig(), prompt_cache_size=0))
        self._next_uid = 0
        self._outbox = None  # one request at a time: each event wakes its consumer directly

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "mode": "sequential"}

    # ---- engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        self._ready.set()
        while True:
            with self._wake:
                while not self._stopping and not self._pending and not self._calls:
                    self._wake.wait(0.5)
                if self._stopping and not self._pending:
                    break
            self._run_calls()  # preparing the next requests' media: between generations
            with self._wake:
                if not self._pending:
                    continue
                seq = self._pending.popleft()
            if seq.handle.cancelled:
                self._finish(seq, "cancelled")
                continue
            self._serve(seq)
        self._fail_all("cancelled", reason="cancelled")
        self._fail_calls()

    def _serve(self, seq: _Seq) -> None:
        seq.uid = self._next_uid
        self._next_uid += 1
        with self._wake:
            self._active[seq.uid] = seq
        self._kv_in_use += seq.kv_bytes
        reason, error = "error", None
        try:
            reason = self._generate(seq)
        except Exception as e:  # a fault in this request: report it, keep serving
            traceback.print_exc()
            error = f"internal error during generation: {type(e).__name__}: {e}"
        finally:
            with self._wake:
                self._active.pop(seq.uid, None)
            mx.clear_cache()
        self._finish(seq, reason, error=error)

    def _generate(self, seq: _Seq) -> str:
        """Run one request to its end; return its finish reason."""
        from mlx_vlm.generate import generate_step

        req = seq.req
        seq.detok = self.tokenizer.detokenizer
        seq.stops = StopMatcher(req.stop)
        seq.t_start = time.perf_counter()
        seq.handle.push(Started(0))  # no prefix cache for vision prompts
        inputs = dict(req.vision_inputs or {})
        pixel_values = inputs.pop("pixel_values", None)
        mask = inputs.pop("attention_mask", None)
        processors = list(make_processors(req.sampling)) + list(req.logits_processors)
        if req.ignore_eos:  # as the text engine: the end-of-sequence tokens are never chosen
            processors.append(mask_tokens(list(self._eos)))
        steps = generate_step(
            mx.array([req.prompt_tokens]),
            self.model,
            pixel_values,
            mask,
            max_tokens=req.max_tokens,
            sampler=make_sampler(req.sampling),
            logits_processors=processors or None,
            prefill_step_size=self.config.prefill_step_size,
            **inputs,
        )
        eos = set() if req.ignore_eos else set(self._eos)
        try:
            for token, logprobs in steps:
                self._run_calls()  # and between the tokens of a long one
                if seq.handle.cancelled:
                    return "cancelled"
                if not seq.t_first:
                    seq.t_first = time.perf_counter()
                seq.n_generated += 1
                finish = None
                if token in eos:
                    finish = "stop"
                elif seq.n_generated >= req.max_tokens:
                    finish = "length"
                reason = self._on_token(seq, _Step(int(token), logprobs, finish))
                if reason is not None:
                    return reason
        finally:
            steps.close()
        return "cancelled" if seq.handle.cancelled else "length"
