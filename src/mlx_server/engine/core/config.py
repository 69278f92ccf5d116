"""The engine's settings (``EngineConfig``), one place for what start-up decides; the runner
is not one of them: start-up builds it and hands it to the engine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from mlx_server.engine.cache.checkpoints import CHUNK_EVERY
from mlx_server.engine.cache.prefix import PrefixCache
from mlx_server.engine.runners.base import Runner
from mlx_server.types import GenerationRequest

if TYPE_CHECKING:  # the disk tier's module is imported only where one is built
    from mlx_server.engine.cache.disk import DiskPromptCache


class Lockstep(Protocol):
    """Rank 0's side of several ranks that compute each step together (the model sharded
    across them; ``lockstep.leader.Lead``)."""

    def lead(
        self, runner: Runner, prefix_cache: PrefixCache | None, config: EngineConfig
    ) -> Runner:
        """The engine's runner, wrapped to journal what it does for the other ranks."""
        ...

    def idle(self) -> None:
        """The engine is idle: the other ranks hear from rank 0 all the same."""
        ...

    def broken(self, error: BaseException) -> None:
        """A step failed: the ranks may no longer agree, serving stops."""
        ...


@dataclass
class EngineConfig:
    max_batch_size: int = 8
    max_queue: int = 64
    prefill_step_size: int = 512
    prompt_cache_size: int = 16
    prompt_cache_bytes: int = 2 << 30
    kv_budget_bytes: int = 4 << 30
    kv_bytes_per_token: int = 1
    kv_bytes_per_sequence: int = 0  # sliding windows and recurrent states (memory_plan)
    prompt_cache_disk: DiskPromptCache | None = None  # the prefix cache's disk tier
    prompt_cache_disk_off: str = ""  # without one: why (reported by /health)
    # Run every batch size once: a lone request's shapes before serving, the rest while idle
    # (tuning.WarmUp; all before serving when ranks run in lockstep).
    warm_up: bool = False
    # Seconds the engine must have been idle before the next warm-up piece: a conversation's
    # next message, typed soon after a reply, does not land on one.
    warm_idle_s: float = 1.5
    # Compute one token before serving (tuning.first_token); a failure is ``start_error``.
    first_token: bool = False
    # Say ready this many seconds into that first token if it has not finished: start-up
    # sets it where kernels are built on first use, so that a cold kernel cache (seconds of
    # builds a first request would wait for all the same) does not hold the readiness line;
    # a failure after it refuses requests with the reason (``Engine.submit``).
    ready_after_s: float = float("inf")
    # Bytes this engine's model keeps resident (weights and KV budget): its share of the
    # process's wired limit while it runs (wired.py; Metal only).
    wired_bytes: int = 0
    solo: bool = True  # a lone request runs on a plain KV cache (see solo.py)
    gather_s: float = 0.05  # how long queued requests wait for announced ones (Scheduler)
    prefill_buckets: bool = False  # the lone path pads prefill chunks (tuning.PREFILL_BUCKETS)
    # The longest key buffer whose lone decode step the idle-time warm-up runs (0: none;
    # tuning.lone_decode_lengths: CUDA builds a cuDNN graph per buffer length).
    lone_decode_keys: int = 0
    # A step that takes this long is logged with its parts (slow_steps.py); start-up sets
    # it where steps of seconds are anomalies (CUDA: kernels built on first use), not where
    # a big model's prefill chunk takes that long by itself (a CPU, Metal).
    slow_step_s: float = float("inf")
    # Rank 0 of several ranks in lockstep: its runner is wrapped to journal for the others.
    lockstep: Lockstep | None = None
    # Tokens between the chunk-boundary checkpoints of a long prefill (cache/checkpoints.py).
    checkpoint_every: int = CHUNK_EVERY
    # A vision model's tower memory for a request's media, counted at its admission
    # (runners/vision_memory.py); None: nothing besides KV.
    media_bytes: Callable[[GenerationRequest], int] | None = None
