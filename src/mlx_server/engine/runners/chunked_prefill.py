"""The prompt of a lone sequence fed into its own KV cache in chunks: the lone-request
runner's (``solo.SoloSequence``) and the speculative one's (``SpeculativeSequence``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlx_server.engine.cache.mrope import DeltaKVCache
from mlx_server.engine.core.tuning import bucket
from mlx_server.engine.runners.base import Progress


class ChunkedPrefill:
    """``fed``: the tokens in the cache; ``_todo``: the prompt tokens still to feed. Each
    ``_prefill_chunk`` feeds up to ``prefill_step_size`` of them, pausing at each of
    ``pauses`` (where the system prompt ends, and checkpoints: so the prefix cache can keep
    the state there), and never the last one: the first decode step feeds it and samples
    from its logits."""

    def __init__(
        self,
        model: Any,
        uid: int,
        prompt: list[int],
        cached: int,
        cache: Any,
        *,
        prefill_step_size: int,
        pauses: Sequence[int] = (),
        buckets: bool = False,
    ):
        self.model = model
        self.uid = uid
        self.cache = cache if cache is not None else make_prompt_cache(model)
        self.fed = list(prompt[:cached])
        self._todo = list(prompt[cached:])
        self._total = len(self._todo)
        self._step_size = prefill_step_size
        self._pauses = sorted(pauses)
        # Pad prefill chunks to bucket lengths (kernels built per shape meet a known one); a
        # plain KV cache can drop the padding again (a Qwen-VL sequence's too: its position
        # delta stays as it is, the positions follow the offset).
        self._buckets = buckets and all(type(c) in (KVCache, DeltaKVCache) for c in self.cache)

    def _prefill_chunk(self) -> Progress:
        n = min(self._step_size, len(self._todo) - 1)
        pause = next((p for p in self._pauses if p > len(self.fed)), 0)
        if pause:
            n = min(n, pause - len(self.fed))
        chunk = self._todo[:n]
        padded = bucket(n, self._step_size) if self._buckets else n
        # The padding comes after the chunk: causal attention keeps it out of the chunk's
        # keys and values, and trimming the cache drops its own.
        self.model(mx.array(chunk + chunk[-1:] * (padded - n))[None], cache=self.cache)
        if padded > n:
            for c in self.cache:
                c.trim(padded - n)
        mx.eval([c.state for c in self.cache])
        self.fed += self._todo[:n]
        self._todo = self._todo[n:]
        mx.clear_cache()
        # Segments end at the pauses and where the prefill does (the last token is fed by
        # the first decode step): as in mlx-lm's BatchGenerator.
        at_end = len(self.fed) == pause or len(self._todo) == 1
        return Progress(self.uid, (self._total - len(self._todo), self._total), at_end)
