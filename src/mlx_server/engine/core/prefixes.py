"""The engine's side of the prefix cache (``cache.prefix.PrefixCache``): what a starting
sequence takes from it, where its prefill pauses to save (the system prompt's end,
checkpoints), the saves themselves, and the KV state a leaving sequence leaves there."""

from __future__ import annotations

import threading
from typing import Any

from mlx_server.engine.cache.checkpoints import needs_checkpoints, pauses
from mlx_server.engine.cache.prefix import CHECKPOINT, SYSTEM, PrefixCache
from mlx_server.engine.core.delivery import Seq
from mlx_server.engine.runners.base import Progress, Runner
from mlx_server.types import GenerationRequest


class Prefixes:
    """``cache`` None: no prefix cache (nothing fetched, paused for or kept)."""

    def __init__(
        self, cache: PrefixCache | None, runner: Runner, model: Any, checkpoint_every: int
    ):
        self.cache = cache
        self._runner = runner
        # Keep each prompt's state before generation where a cache cannot be rewound.
        self.checkpoints = cache is not None and needs_checkpoints(model)
        self._every = checkpoint_every

    def watch_reads(self, wake: threading.Condition) -> None:
        """Wake the engine thread when a prefix read from disk is ready."""

        def notify() -> None:
            with wake:
                wake.notify()

        if self.cache is not None:
            self.cache.on_loaded = notify

    @property
    def reading(self) -> bool:
        """Whether a disk-tier read is in flight (see ``PrefixCache.prepare``)."""
        return self.cache is not None and self.cache.loading

    def fetch(self, req: GenerationRequest) -> tuple[Any, list[int]]:
        """The cached KV state of the longest cached prefix of ``req``'s prompt, and the
        tokens left to prefill."""
        prompt = list(req.prompt_tokens)
        if self.cache is None:
            return None, prompt
        return self.cache.fetch(req.cache_key)

    def system_end(self, seq: Seq, prompt: list[int]) -> int:
        """Where the prefill pauses to save the system prompt's KV state: where that prefix
        ends, when it is not cached yet (0: no pause)."""
        end = seq.req.system_prefix_tokens
        if self.cache is None or not seq.started.cached_tokens < end < len(prompt) - 1:
            return 0
        return end

    def checkpoints_of(self, req: GenerationRequest, cached: int) -> tuple[int, ...]:
        """Where the prefill pauses for checkpoints (none for a cache that can be rewound)."""
        if not self.checkpoints:
            return ()
        n = len(req.prompt_tokens)
        return pauses(n, cached, history_end=req.history_end, every=self._every)

    def save(self, progress: list[Progress], active: dict[int, Seq]) -> None:
        """At the end of a system-prompt segment, cache its KV state as a system entry; at
        the end of any other segment (checkpoints, and the prompt less its last token), where
        the cache cannot be rewound, as a checkpoint. A failure to copy a state drops it
        (logged once)."""
        pc = self.cache
        if pc is None:
            return
        uids = [
            p.uid
            for p in progress
            if p.end_of_segment
            and not p.end_of_prompt
            and p.uid in active
            and (active[p.uid].system_end or self.checkpoints)
        ]
        if not uids:
            return
        try:
            states = self._runner.extract_state(uids)
        except Exception as e:
            pc.faults.note("copying a prompt's state", e)
            return
        for uid, (cache, tokens) in states.items():
            seq = active[uid]
            if seq.system_end and len(tokens) == seq.system_end:
                pc.insert(list(tokens), cache, SYSTEM)
                seq.system_end = 0
            elif self.checkpoints:  # a pause planned by checkpoints_of, or the prompt's end
                pc.insert(list(tokens), cache, CHECKPOINT)

    def keep(self, seq: Seq, cache: Any, tokens: Any) -> None:
        """Store a leaving sequence's KV state (prompt and generated tokens) for reuse."""
        if self.cache is not None and cache is not None and len(tokens) > seq.started.cached_tokens:
            self.cache.insert(list(tokens), cache)

    def settle(self, everything: bool = False) -> None:
        """Before each step, and with ``everything`` once nothing runs: the states handed to
        the disk tier whose arrays are computed by now go to its writer."""
        if self.cache is not None:
            self.cache.settle(everything)

    def close(self) -> None:
        """RAM entries to the disk tier, within a deadline; a failure is noted, not raised
        (the last writes are a service: stopping goes on)."""
        if self.cache is not None:
            try:
                self.cache.close()
            except Exception as e:
                self.cache.faults.note("writing the cache at shutdown", e)
