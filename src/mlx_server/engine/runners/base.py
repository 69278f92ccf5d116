"""The runner interface: what the engine's scheduler asks of whatever decodes its sequences.

The engine is a scheduler (``scheduler.py``: the queue, admission, fairness, the KV budget)
and one runner behind this small interface. The scheduler decides *which* request starts
and when; a runner decides *how* its sequences are computed:

- ``insert(job)`` starts one sequence (its prompt, cached KV state, sampler and logits
  processors come in an ``Insert``), keyed by the ``uid`` the scheduler gave it;
- ``step()`` advances every sequence once and answers prefill ``Progress`` and one
  ``Response`` (token, log-probabilities, finish reason) per sequence that produced a token;
  a sequence whose own work failed (a vision prompt's prefill chunk) is reported by a
  ``Progress`` with its ``error``, and the engine ends that sequence alone;
- ``remove(uids)`` takes sequences out, returning their KV state (cache, tokens) so that
  the prefix cache can keep it;
- ``extract_state(uids)`` copies sequences' KV state while they go on (the system-prompt
  prefix, saved as it is prefilled);
- ``reset()`` drops everything after a fault no sequence could be blamed for.

A runner is used from the engine thread only. The runners today:

- ``batch_runner.BatchRunner``: continuous batching over mlx-lm's ``BatchGenerator``;
- ``solo.SoloRunner``: one sequence on a plain KV cache (mlx-lm's ``generate_step`` path);
- ``solo.LoneFirstRunner``: the text engine's default, a lone request on the solo runner,
  handed over to the batch runner when a second one starts;
- ``vision_batch.VisionBatchRunner``: a vision model's requests, images prefilled through
  the vision tower (``vision_prefill``), decoded in the batch over its language model;
- ``vision.VisionRunner``: one vision request at a time with mlx-vlm's ``generate_step``
  (the families not batched).

How a new runner plugs in: write a class with these methods and pass it to ``Engine`` as
``runner=``. A speculative decoder is one such runner (draft several tokens, verify them in
one forward pass, answer several ``Response`` for a sequence in one ``step``); it may also
take the solo runner's place inside ``LoneFirstRunner`` (a ``solo.LoneRunner``: ``busy``
and ``hand_over``) so that a second request still joins the batch. An encoder-only runner (embeddings) answers each sequence with one
``Response`` carrying ``finish_reason="stop"``. Several models in one process are several
``Engine`` instances, each with its own thread and runner; nothing is shared between them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import mlx.core as mx

from mlx_server.engine.sampling.samplers import LogitsProcessor, Sampler
from mlx_server.types import GenerationRequest

KVState = tuple[Any, list[int]]  # (a prompt cache, the tokens in it)


@dataclass
class Insert:
    """What a runner needs to start one sequence (built by the engine)."""

    uid: int
    request: GenerationRequest
    prompt: list[int]
    cached: int  # prompt tokens already in ``cache`` (a prefix-cache hit)
    cache: Any  # the prompt cache to continue from, or None for a fresh one
    sampler: Sampler
    processors: list[LogitsProcessor] = field(default_factory=list)
    system_end: int = 0  # pause the prefill here so the system prompt's state can be saved
    alone: bool = False  # nothing else runs or waits: a runner may take a faster lone path
    # Further pauses, for checkpoints of a cache that cannot be rewound (cache/checkpoints.py).
    checkpoints: tuple[int, ...] = ()

    @property
    def pauses(self) -> list[int]:
        """Prompt offsets past the cached ones where the prefill pauses, in order."""
        points = {self.system_end, *self.checkpoints}
        return sorted(p for p in points if self.cached < p < len(self.prompt))

    @property
    def segments(self) -> list[list[int]]:
        """The uncached prompt, split where it pauses (its states are to be saved there)."""
        bounds = [self.cached, *self.pauses, len(self.prompt)]
        return [self.prompt[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@dataclass
class Progress:
    """Prefill progress of one sequence: ``progress`` is (tokens done, tokens to do).
    ``error``: this sequence's own step failed (why); the runner has dropped its work, the
    engine ends it with that error and the others go on."""

    uid: int
    progress: tuple[int, int]
    end_of_segment: bool = False
    end_of_prompt: bool = False
    error: str | None = None


@dataclass
class Response:
    """One generated token. ``finish_reason`` is "stop" (an end-of-sequence token, not part
    of the text) or "length"; a finished sequence carries its KV state for the prefix cache."""

    uid: int
    token: int
    logprobs: mx.array
    finish_reason: str | None
    prompt_cache: Any = None
    all_tokens: list[int] | None = None
    # Speculative decoding: tokens drafted and accepted in the step that produced this one
    # (counted on the step's first response only).
    drafted: int = 0
    draft_accepted: int = 0
    # The request's log-probability figures made in the step's graph (the lone path, for a
    # request with ``logprobs``); None: read from ``logprobs`` when delivered.
    picked: Any = None


class Runner(Protocol):
    """Computes the scheduler's sequences; see the module docstring."""

    def insert(self, job: Insert) -> None:
        """Start a sequence; raises (and starts nothing) when the job cannot run."""

    def step(self) -> tuple[list[Progress], list[Response]]:
        """Advance every sequence one step."""
        ...

    def remove(self, uids: list[int]) -> dict[int, KVState]:
        """Take sequences out; their KV state where the runner can give it."""
        ...

    def extract_state(self, uids: list[int]) -> dict[int, KVState]:
        """A copy of running sequences' KV state; they go on."""
        ...

    def reset(self) -> None:
        """Forget every sequence (after a fault); the runner serves again afterwards."""

    def close(self) -> None:
        """Release what the runner holds (engine shutdown)."""

    def stats(self) -> dict[str, Any]:
        """The runner's own monitoring counters (merged into the engine's)."""
        ...
