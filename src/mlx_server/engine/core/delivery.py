"""A sequence's bookkeeping and the events it delivers: tokens to text, stop strings,
log-probabilities, and the ``Finished`` event with its usage and timings.

Runners produce token ids; everything a client sees of them is made here, the same for
every runner, so the solo, batch and vision paths cannot differ in their output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from mlx_server.engine.core.handle import GenerationHandle, Started, TokenPiece
from mlx_server.engine.runners.base import Response
from mlx_server.engine.sampling.logprobs import logprob_entry
from mlx_server.engine.sampling.samplers import SharedSampler
from mlx_server.events import Finished, LogprobEntry, Timings, Usage, finish_reason
from mlx_server.logs import log
from mlx_server.parsing.stops import StopMatcher
from mlx_server.types import GenerationRequest

WAIT_LOGGED_S = 0.5  # a wait to start this long shows in the request's Generation line


@dataclass
class Seq:
    """One request from submission to its end (owned by the engine thread once admitted)."""

    req: GenerationRequest
    handle: GenerationHandle
    uid: int = -1  # the runner's key, from admission on
    detok: Any = None
    stops: StopMatcher | None = None
    n_generated: int = 0
    # Its first event (how much of the prompt the prefix cache covered), from admission on.
    started: Started = field(default_factory=Started)
    t_submit: float = 0.0
    t_start: float = 0.0
    t_first: float = 0.0
    kv_bytes: int = 0
    media_bytes: int = 0  # the vision tower's memory for its media, counted at admission
    system_end: int = 0  # prompt offset where the system prompt's KV state is worth caching
    prefill_left: int = 0  # prompt tokens still to prefill once inserted (0: decoding)
    uncached: int = -1  # estimate, while queued, of the tokens it will have to prefill
    logprobs: list[LogprobEntry] = field(default_factory=list)
    fault: str | None = None  # its own sampler, processors or prefill (the runner's) failed
    shared: SharedSampler | None = None  # the sampler it shares with same-settings sequences
    draft_n: int = 0  # speculative decoding: tokens drafted for it
    draft_accepted: int = 0  # of those, accepted

    def begin_output(self, tokenizer: Any) -> None:
        """Ready the detokenizer and stop strings (when the sequence starts running)."""
        self.detok = tokenizer.detokenizer
        if self.req.continues_text:
            _continue_after(self.detok, self.req.prompt_tokens)
        self.stops = StopMatcher(self.req.stop)
        self.t_start = time.perf_counter()


def _continue_after(detok: Any, prompt: list[int]) -> None:
    """Start ``detok`` mid-text, after the prompt. mlx-lm's detokenizers drop a leading space
    at the start of their text (as a sentencepiece decode does); started mid-text, the first
    generated token keeps its space (" Paris" after "The capital of France is"). They read
    each token on its own, so any prompt token with text of its own will do: the last one,
    unless it is a lone space (dropped itself). What they read here is never output."""
    for token in reversed(prompt):  # bounded by the prompt; one step but for lone spaces
        detok.add_token(token)
        detok.finalize()
        if detok.text:
            break
    _ = detok.last_segment


def deliver_token(tokenizer: Any, seq: Seq, r: Response) -> str | None:
    """Detokenize, apply stop strings and logprobs, push the piece; return a finish reason
    ("stop_sequence" for a stop string, else the runner's) or None."""
    if not seq.t_first:
        seq.t_first = time.perf_counter()
        seq.prefill_left = 0
    seq.n_generated += 1
    seq.draft_n += r.drafted
    seq.draft_accepted += r.draft_accepted
    if r.finish_reason == "stop":  # an EOS token: not part of the text
        seq.detok.finalize()
    else:
        seq.detok.add_token(r.token)
        if r.finish_reason == "length":
            seq.detok.finalize()
    text = seq.detok.last_segment
    entries: tuple[LogprobEntry, ...] = ()
    if seq.req.logprobs:
        k = seq.req.top_logprobs
        entries = (logprob_entry(tokenizer, r.token, r.logprobs, k, r.picked),)
    stops = seq.stops
    out = stops.feed(text) if stops else text
    if stops is not None and stops.matched is None and r.finish_reason is not None:
        out += stops.flush()
    if out or entries:
        seq.handle.push(TokenPiece(out, entries))
    if stops is not None and stops.matched is not None:
        return "stop_sequence"
    return r.finish_reason


def deliver_finish(seq: Seq, reason: str, error: str | None = None, quiet: bool = False) -> None:
    """Push the ``Finished`` event and log the generation (``quiet``: not a cancellation)."""
    now = time.perf_counter()
    prompt_n = len(seq.req.prompt_tokens) - seq.started.cached_tokens
    t_first = seq.t_first or now
    timings = Timings(
        prompt_n=prompt_n,
        prompt_ms=((t_first - seq.t_start) * 1000) if seq.t_start else 0.0,
        predicted_n=seq.n_generated,
        predicted_ms=(now - t_first) * 1000,
        cache_n=seq.started.cached_tokens,
        draft_n=seq.draft_n,
        draft_n_accepted=seq.draft_accepted,
    )
    usage = Usage(len(seq.req.prompt_tokens), seq.n_generated, seq.started.cached_tokens)
    predicted = len(seq.req.prediction_tokens)
    if predicted:  # the drafts were the prediction's tokens
        accepted = min(seq.draft_accepted, predicted)
        usage = replace(
            usage,
            accepted_prediction_tokens=accepted,
            rejected_prediction_tokens=predicted - accepted,
        )
    stop = seq.stops.matched if seq.stops is not None else None
    seq.handle.push(
        Finished(finish_reason(reason), usage, timings, stop_sequence=stop, error=error)
    )
    if reason != "cancelled" and seq.n_generated:
        log(
            f"Generation: {timings.prompt_n} prompt tokens at {timings.prompt_per_second:.1f} tokens/sec, "
            f"{timings.predicted_n} generated at {timings.predicted_per_second:.1f} tokens/sec "
            f"(cached {seq.started.cached_tokens}, finish={reason}){_drafts(seq)}{_waited(seq)}"
        )
    elif reason == "cancelled" and not quiet:
        log(f"Generation {seq.req.request_id} cancelled {_progress(seq)}")


def _waited(seq: Seq) -> str:
    """How long the request waited to start, for the log, when it is long enough to matter
    (a full batch, a warm-up piece under way); the rates above count from its start."""
    wait = seq.t_start - seq.t_submit if seq.t_start and seq.t_submit else 0.0
    return f", waited {wait:.1f}s to start" if wait >= WAIT_LOGGED_S else ""


def _drafts(seq: Seq) -> str:
    """Speculative decoding's share of a generation, for the log."""
    if not seq.draft_n:
        return ""
    rate = seq.draft_accepted / seq.draft_n
    return f", drafted {seq.draft_n}, accepted {seq.draft_accepted} ({rate:.0%})"


def _progress(seq: Seq) -> str:
    """Where a generation stood, for the log."""
    if seq.uid < 0:
        return "while queued"
    todo = len(seq.req.prompt_tokens) - seq.started.cached_tokens
    done = todo - seq.prefill_left if not seq.t_first else todo
    return f"after {done} of {todo} prompt tokens prefilled, {seq.n_generated} generated"
