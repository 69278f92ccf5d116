"""The lone-request runner with speculative decoding, in the solo runner's place.

``SpeculativeRunner`` is a ``solo.SoloRunner`` whose sequence drafts and verifies
(``sequence.SpeculativeSequence``) when the request has a drafter: its predicted output,
else the server's draft model, else prompt lookup (``--prompt-lookup``). A request without
one runs on the plain solo sequence. Inside ``LoneFirstRunner`` a second request still
joins the batch: the speculating sequence hands its cache and tokens over like the solo one,
and its drafter and drafting record to the speculating batch runner (``take_handed``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlx_server.engine.core.tuning import ShapePieces, on_gpu
from mlx_server.engine.runners.base import Insert, Progress, Response
from mlx_server.engine.runners.solo import Handover, SoloRunner
from mlx_server.engine.speculative import warm
from mlx_server.engine.speculative.batch import RowSpec
from mlx_server.engine.speculative.costs import StepCosts
from mlx_server.engine.speculative.drafters import (
    Drafter,
    DraftModel,
    PredictedOutput,
    PromptLookup,
)
from mlx_server.engine.speculative.rejection import wants_rejection
from mlx_server.engine.speculative.sequence import SpeculativeSequence


@dataclass
class Speculation:
    """The server's speculative decoding settings."""

    # 15: a pass over 16 rows costs what one over 9 does where the device is the bound
    # (an H200: 8B 4-bit 2.44 against 2.38 decode steps, MLX's 4-bit tile kernel takes
    # 8-16 rows; 17 and more take a dearer one), and the plan narrows it where it does not
    # pay (a CPU, a draft model's drafting). docs/benchmarks.md, "a ninth session".
    num_draft_tokens: int = 15
    prompt_lookup: bool = False
    draft_model: Any = None  # a loaded model with the target's tokenizer, or None
    # False: draft the full length at every step, whatever it costs (tests, benchmarks).
    adaptive: bool = True
    log: Any = None  # plan_log.PlanLog: the plan's decisions, counted (benchmarks)
    # a lone sequence queues its next pass behind the one it reads (sequence.py). None: on
    # a GPU, where the device computes while the host builds the next pass; on a CPU MLX's
    # evaluation of a pass is mostly done by the time it is queued (the demo model's
    # 9-token pass: 94 of 110 ms inside ``mx.async_eval``), so a pass queued ahead
    # overlaps nothing and one built on a rejected pass is a pass's compute wasted
    # (`bench/speculative.py --compare-queued`, code edit: 1.52-1.58 x queued, 1.61-1.63 x not)
    pipelined: bool | None = None


def make_drafter(
    spec: Speculation, job: Insert, draft: DraftModel | None, prefill_step_size: int = 512
) -> Drafter | None:
    """The request's drafter: its predicted output, else the draft model (``draft``, or a
    new one with its own cache), else prompt lookup when enabled; None: no speculation."""
    prediction = job.request.prediction_tokens
    if prediction:
        return PredictedOutput(list(prediction), len(job.prompt))
    if spec.draft_model is not None:
        return draft if draft is not None else DraftModel(spec.draft_model, prefill_step_size)
    if spec.prompt_lookup:
        return PromptLookup()
    return None


class SpeculativeRunner(SoloRunner):
    def __init__(
        self,
        model: Any,
        eos: list[int],
        *,
        prefill_step_size: int,
        spec: Speculation,
        prefill_buckets: bool = False,
    ):
        super().__init__(
            model, eos, prefill_step_size=prefill_step_size, prefill_buckets=prefill_buckets
        )
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
        self._handed: dict[int, RowSpec] = {}
        # Step costs are the model's and the machine's: measured once for every request.
        self.costs = StepCosts(spec.num_draft_tokens)

    def warm_shapes(self, max_batch_size: int) -> ShapePieces:
        """A verify pass of each width, before serving (``warm``)."""
        k = self.spec.num_draft_tokens
        return warm.shapes(warm.lone_pieces(self.model, k), {}, k)

    def drafter(self, job: Insert) -> Drafter | None:
        return make_drafter(self.spec, job, self._draft, self._step_size)

    def hand_over(self) -> tuple[Response | None, Handover | None]:
        seq = self.seq
        pending, rest = super().hand_over()
        if rest is not None and isinstance(seq, SpeculativeSequence):
            self._handed[seq.uid] = RowSpec(seq.drafter, seq.length.acceptance, seq.rejection)
        return pending, rest

    def take_handed(self, uid: int) -> RowSpec | None:
        """The drafter and record of the sequence ``uid`` handed over (once)."""
        return self._handed.pop(uid, None)

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
            adaptive=self.spec.adaptive,
            rejection=wants_rejection(
                job.request.sampling, bool(job.processors) or job.request.ignore_eos
            ),
            max_tokens=job.request.max_tokens,
            eos=self._eos,
            prefill_step_size=self._step_size,
            buckets=self._buckets,
            processors=job.processors,
            system_end=job.system_end,
            checkpoints=job.checkpoints,
            costs=self.costs,
            log=self.spec.log,
            pipelined=on_gpu() if self.spec.pipelined is None else self.spec.pipelined,
        )
        self.seq = seq
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
