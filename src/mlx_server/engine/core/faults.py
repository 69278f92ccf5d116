"""Who a fault belongs to. A request's own sampler, logits processors or output handling
failing ends that request with its error and the batch goes on; a fault no sequence can be
blamed for ends the running ones and the runner starts over; queued requests keep their
place either way. After any fault MLX's global random state is renewed (a step that failed
half-built can leave it pointing at an array that will never be computed)."""

from __future__ import annotations

import traceback
from collections.abc import Iterable

from mlx_server.engine.core.delivery import Seq
from mlx_server.engine.sampling.samplers import reset_random_state
from mlx_server.logs import log


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def blame_shared_samplers(seqs: Iterable[Seq]) -> None:
    """A shared sampler that failed fails every sequence that uses it."""
    for seq in seqs:
        shared = seq.shared
        if seq.fault is None and shared is not None and shared.fault is not None:
            seq.fault = shared.fault


def faulted(seqs: Iterable[Seq]) -> list[Seq]:
    return [s for s in seqs if s.fault is not None]


def note_output_fault(seq: Seq, e: Exception) -> None:
    """This sequence's output handling failed: it ends at the end of the step."""
    traceback.print_exc()
    seq.fault = describe(e)


def start_failed(seq: Seq, e: Exception) -> str:
    """A request failed before it ran (e.g. its sampler): log it; its error message."""
    traceback.print_exc()
    log(f"Error starting generation of {seq.req.request_id}: {describe(e)}")
    reset_random_state()
    return f"generation failed: {describe(e)}"


def step_failed(e: Exception) -> str:
    """A step failed and no sequence is to blame: log it; the running ones' error."""
    traceback.print_exc()
    log(f"Error during generation: {describe(e)}")
    reset_random_state()
    return f"internal error during generation: {describe(e)}"


def sequence_failed(seq: Seq) -> str:
    log(f"Error during generation of {seq.req.request_id}: {seq.fault}")
    return f"generation failed: {seq.fault}"
