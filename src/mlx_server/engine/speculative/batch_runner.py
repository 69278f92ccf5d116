"""The batch runner with speculative decoding: ``batch_runner.BatchRunner`` whose running
batch verifies drafts (``batch.SpeculativeGenerationBatch``).

A sequence speculates in the batch when the request has a drafter, by the same rule as on
the lone path (``runner.make_drafter``): its predicted output, else the server's draft
model (each row its own draft cache), else prompt lookup. A speculating lone sequence
handed over to the batch keeps its drafter and its drafting record (``adopt``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlx_lm.generate import BatchGenerator

from mlx_server.engine.core.tuning import ShapePieces
from mlx_server.engine.runners.base import Insert, Progress, Response
from mlx_server.engine.runners.batch import BatchRunner
from mlx_server.engine.sampling.samplers import LogitsProcessor, Sampler
from mlx_server.engine.speculative import warm
from mlx_server.engine.speculative.batch import BatchSpeculator, RowSpec, install
from mlx_server.engine.speculative.costs import StepCosts
from mlx_server.engine.speculative.drafters import DraftModel
from mlx_server.engine.speculative.rejection import wants_rejection
from mlx_server.engine.speculative.runner import Speculation, make_drafter

# A sequence handed over by the lone runner: its drafter and record, by the scheduler's uid.
Adopt = Callable[[int], RowSpec | None]


class SpeculativeBatchRunner(BatchRunner):
    def __init__(
        self,
        model: Any,
        eos: list[int],
        *,
        max_batch_size: int,
        prefill_step_size: int,
        spec: Speculation,
        keep_caches: bool = True,
    ):
        self.spec = spec
        # Step costs are the model's and the machine's: kept across generators.
        self.costs = StepCosts(spec.num_draft_tokens)
        self.speculator = BatchSpeculator(spec.num_draft_tokens, adaptive=spec.adaptive)
        self.adopt: Adopt | None = None  # set when a lone runner hands sequences over
        self.draft_n = 0
        self.draft_accepted = 0
        super().__init__(
            model,
            eos,
            max_batch_size=max_batch_size,
            prefill_step_size=prefill_step_size,
            keep_caches=keep_caches,
        )

    def _new_generator(self) -> BatchGenerator:
        gen = super()._new_generator()
        self.speculator = BatchSpeculator(
            self.spec.num_draft_tokens,
            adaptive=self.spec.adaptive,
            model=self.model,  # not the decode step's grammar-masking wrapper
            extra_processors=self._grammar_of,
            costs=self.costs,
            log=self.spec.log,
        )
        install(gen, self.speculator)
        return gen

    def warm_shapes(self, max_batch_size: int) -> ShapePieces:
        """A verifying step of each width at each batch size (``warm``): a lone one's
        before serving, the others in idle time."""
        k, step = self.spec.num_draft_tokens, self._step_size
        pieces = warm.batch_pieces(
            self.model, k, range(1, max_batch_size + 1), max_batch_size, step
        )
        return warm.shapes(pieces.pop(1), pieces, k)

    def _grammar_of(self, gen_uid: int) -> tuple[Any, ...]:
        """A row's grammar when the batch masks it (it has left mlx-lm's per-row list): in
        a verifying step it is called per position like any processor, on the same state."""
        row = self._grammars.get(gen_uid)
        return (row.listed,) if row is not None and row.adopted else ()

    def insert(self, job: Insert) -> None:
        super().insert(job)
        drafter = make_drafter(self.spec, job, None)
        if drafter is None:
            return
        rejection = None
        if isinstance(drafter, DraftModel):
            rejection = wants_rejection(
                job.request.sampling, bool(job.processors) or job.request.ignore_eos
            )
        self.speculator.rows[self._gen_uid[job.uid]] = RowSpec(drafter, rejection=rejection)

    def join(
        self,
        uid: int,
        segments: list[list[int]],
        cache: Any,
        fed: list[int],
        max_tokens: int,
        sampler: Sampler,
        processors: list[LogitsProcessor],
        top_logprobs: int = -1,
    ) -> None:
        super().join(uid, segments, cache, fed, max_tokens, sampler, processors, top_logprobs)
        row = self.adopt(uid) if self.adopt is not None else None
        if row is not None:
            self.speculator.rows[self._gen_uid[uid]] = row

    def step(self) -> tuple[list[Progress], list[Response]]:
        ours = dict(self._uid)  # finished sequences are forgotten during the step
        progress, responses = super().step()
        counts = {ours[g]: c for g, c in self.speculator.counts.items() if g in ours}
        for r in responses:
            drafted, accepted = counts.pop(r.uid, (0, 0))  # on each row's first response
            r.drafted, r.draft_accepted = drafted, accepted
            self.draft_n += drafted
            self.draft_accepted += accepted
        return progress, responses

    def _forget(self, uid: int) -> None:
        gen_uid = self._gen_uid.get(uid)
        if gen_uid is not None:
            self.speculator.rows.pop(gen_uid, None)
        super()._forget(uid)

    def stats(self) -> dict[str, Any]:
        return {
            **super().stats(),
            "draft_tokens": self.draft_n,
            "draft_accepted_tokens": self.draft_accepted,
        }
