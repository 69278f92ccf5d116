"""The lone-request runner with speculative decoding, in the solo runner's place.

``SpeculativeRunner`` is a ``solo.SoloRunner`` whose sequence drafts and verifies
(``sequence.SpeculativeSequence``) when the request has a drafter: its predicted output,
else the server's draft model, else prompt lookup (``--prompt-lookup``). A request without
one runs on the plain solo sequence. Inside ``LoneFirstRunner`` a second request still
joins the batch: the speculating sequence hands its cache and tokens over like the solo one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_server.engine.runner import Insert, Progress, Response
from mlx_server.engine.solo import SoloRunner
from mlx_server.engine.speculative.drafters import (
    Drafter,
    DraftModel,
    PredictedOutput,
    PromptLookup,
)
from mlx_server.engine.speculative.sequence import SpeculativeSequence


@dataclass
class Speculation:
    """The server's speculative decoding settings."""

    num_draft_tokens: int = 4
    prompt_lookup: bool = False
    draft_model: Any = None  # a loaded model with the target's tokenizer, or None


class SpeculativeRunner(SoloRunner):
    def __init__(self, model: Any, eos: list[int], *, prefill_step_size: int, spec: Speculation):
        super().__init__(model, eos, prefill_step_size=prefill_step_size)
        self.spec = spec
        # One draft model cache for every request: it rewinds to the common prefix, so a
        # conversation's next turn feeds the draft model only its new tokens.
        self._draft = (
            DraftModel(spec.draft_model, prefill_step_size)
            if spec.draft_model is not None
            else None
        )
        self.draft_n = 0
        self.draft_accepted = 0

    def drafter(self, job: Insert) -> Drafter | None:
        prediction = job.request.prediction_tokens
        if prediction:
            return PredictedOutput(list(prediction), len(job.prompt))
        if self._draft is not None:
            return self._draft
        if self.spec.prompt_lookup:
            return PromptLookup()
        return None

    def insert(self, job: Insert) -> None:
        drafter = self.drafter(job)
        if drafter is None:
            super().insert(job)
            return
        if self.seq is not None:
            raise RuntimeError("the solo runner runs one sequence at a time")
        seq = SpeculativeSequence(
            self.model,
            job.uid,
            job.prompt,
            job.cached,
            job.cache,
            sampler=job.sampler,
            # ignore_eos lives in the sampler: a plain argmax would not honour it
            greedy=job.request.sampling.temperature <= 0 and not job.request.ignore_eos,
            drafter=drafter,
            num_draft_tokens=self.spec.num_draft_tokens,
            max_tokens=job.request.max_tokens,
            eos=self._eos,
            prefill_step_size=self._step_size,
            processors=job.processors,
            system_end=job.system_end,
        )
        self.seq = seq  # type: ignore[assignment]  # the solo sequence's interface
        self.runs += 1

    def step(self) -> tuple[list[Progress], list[Response]]:
        progress, responses = super().step()
        for r in responses:
            self.draft_n += r.drafted
            self.draft_accepted += r.draft_accepted
        return progress, responses

    def stats(self) -> dict[str, Any]:
        return {
            **super().stats(),
            "draft_tokens": self.draft_n,
            "draft_accepted_tokens": self.draft_accepted,
        }
