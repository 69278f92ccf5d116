"""Vision-language models in the continuous batch, with the prefix cache.

A request whose uncached prompt holds images or videos is prefilled by a ``VisionPrefill``
(the vision tower and the language model over the prompt's embeddings, a chunk per step,
interleaved with the batch's decode steps); then it joins the ``BatchRunner`` over the
language model. Every other request — text-only, or one whose media are all in its cached
prefix — is a text request of the language model and takes the text path: the lone runner
while it is alone, the batch otherwise (``solo.LoneFirstRunner``). A prefill that fails
(the tower at ``insert``, a chunk at ``step``) fails its own request only: each prompt is
prefilled into a cache of its own, and a chunk's failure comes back as that sequence's
``Progress.error``.

The prefix cache keys a prompt with media by ``GenerationRequest.cache_key``: the prompt's
tokens with each media placeholder replaced by a digest of the media (``models/
media_key.py``), so the same image in the next turn hits and a different one misses. The
runner keeps its sequences' real tokens (the processors' context) and answers their KV
states in the key's terms, which is what the engine stores.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import mlx.core as mx

from mlx_server.engine.cache.mrope import set_delta
from mlx_server.engine.runners.base import Insert, KVState, Progress, Response
from mlx_server.engine.runners.batch import BatchRunner
from mlx_server.engine.runners.solo import LoneFirstRunner, SoloRunner
from mlx_server.engine.runners.vision_prefill import LanguageModel, VisionPrefill


class VisionBatchRunner:
    """Prefills prompts with media itself; every sequence decodes on the text path's
    runners (the lone runner while alone, the batch otherwise)."""

    def __init__(
        self,
        vlm: Any,
        eos: list[int],
        *,
        max_batch_size: int,
        prefill_step_size: int,
        keep_caches: bool = True,
        solo: bool = True,
        prefill_buckets: bool = False,
        make_batch: Callable[..., BatchRunner] = BatchRunner,
    ):
        """``solo``: a lone request without media runs on the lone runner, as on the text
        path (``solo.LoneFirstRunner``), its prefill chunks padded to bucket lengths with
        ``prefill_buckets``."""
        self.vlm = vlm
        self.lm = LanguageModel(vlm)
        self.batch = make_batch(
            self.lm,
            eos,
            max_batch_size=max_batch_size,
            prefill_step_size=prefill_step_size,
            keep_caches=keep_caches,
        )
        # Where requests without media (or with all of it cached) go: the text path.
        self.text: LoneFirstRunner | BatchRunner = self.batch
        if solo:
            lone = SoloRunner(
                self.lm, eos, prefill_step_size=prefill_step_size, prefill_buckets=prefill_buckets
            )
            self.text = LoneFirstRunner(lone, self.batch)
        self._step_size = prefill_step_size
        self._prefills: dict[int, VisionPrefill] = {}
        self._keys: dict[int, list[int]] = {}  # uid -> its prompt as the prefix cache keys it
        self._unkeyed: set[int] = set()  # media without a key (``cache_tokens``)
        self.vision_prefills = 0  # prompts with media prefilled here (monitoring, tests)
        self.peak_batch = 0  # the most sequences decoding together (monitoring, tests)

    def __len__(self) -> int:
        lone = isinstance(self.text, LoneFirstRunner) and self.text.lone.busy
        return len(self.batch) + len(self._prefills) + int(lone)

    def insert(self, job: Insert) -> None:
        req = job.request
        if req.vision_inputs is not None and self._media_ahead(job):
            # The vision tower runs here: media the model cannot take fail this request only.
            prefill = VisionPrefill(self.vlm, self.lm, job, prefill_step_size=self._step_size)
            self._prefills[job.uid] = prefill
            self.vision_prefills += 1
        else:
            if self.lm.mrope:  # the cache says where this sequence's positions go on
                job.cache = job.cache if job.cache is not None else self.lm.make_cache()
                set_delta(job.cache, self.lm.rope_delta(job))
            self.text.insert(job)
        if req.vision_inputs is not None and req.cache_tokens is None:
            self._unkeyed.add(job.uid)  # no key for its media: its state is not kept
        elif req.cache_tokens is not None:
            self._keys[job.uid] = req.cache_tokens

    @staticmethod
    def _media_ahead(job: Insert) -> bool:
        """Whether media placeholders (where the key differs from the tokens) lie past the
        cached prefix, before the last token (the batch feeds that one as a token: a chat
        prompt's is text)."""
        key = job.request.cache_tokens
        todo = slice(job.cached, len(job.prompt) - 1)
        return key is None or key[todo] != job.prompt[todo]

    def step(self) -> tuple[list[Progress], list[Response]]:
        # A prompt prefilled last step goes on now (until then the engine could take its
        # state at the prompt's end: a checkpoint, for caches that cannot be rewound), as a
        # prefix-cache hit would: on the lone runner if it is alone, else in the batch.
        failed: list[Progress] = []
        for uid, prefill in list(self._prefills.items()):
            if prefill.done:
                del self._prefills[uid]
                job = prefill.job
                alone = job.alone and not self._prefills
                cached = len(prefill.fed)
                joining = replace(
                    job,
                    cached=cached,
                    cache=prefill.cache,
                    system_end=0,
                    checkpoints=(),
                    alone=alone,
                )
                try:  # a runner's insert that raises starts nothing: this request's failure
                    self.text.insert(joining)
                except Exception as e:
                    failed.append(self._failed(prefill, "joining the batch failed", e))
        progress = failed + [self._prefill_step(uid, p) for uid, p in list(self._prefills.items())]
        if isinstance(self.text, BatchRunner) and not len(self.batch):
            return progress, []
        more, responses = self.text.step()
        self.peak_batch = max(self.peak_batch, len(self.batch))
        for r in responses:
            if r.all_tokens is not None:
                r.all_tokens = self._keyed(r.uid, r.all_tokens)
                if r.uid in self._unkeyed:
                    r.prompt_cache = None
            if r.finish_reason is not None:
                self._forget(r.uid)
        return progress + more, responses

    def _prefill_step(self, uid: int, prefill: VisionPrefill) -> Progress:
        """One chunk of a prompt's prefill. Its failure is this request's alone (its cache is
        its own): the prefill is dropped and the engine ends the request with the error."""
        try:
            return prefill.step()
        except Exception as e:
            del self._prefills[uid]
            return self._failed(prefill, "prefill failed", e)

    @staticmethod
    def _failed(prefill: VisionPrefill, what: str, e: Exception) -> Progress:
        """The ``Progress`` that reports a prefilled request's own failure to the engine."""
        traceback.print_exc()
        mx.clear_cache()
        job = prefill.job
        done, total = len(prefill.fed) - job.cached, len(job.prompt) - job.cached
        return Progress(prefill.uid, (done, total), error=f"{what}: {type(e).__name__}: {e}")

    def remove(self, uids: list[int]) -> dict[int, KVState]:
        out = {u: self._prefills.pop(u).state(copied=False) for u in uids if u in self._prefills}
        out.update(self.text.remove(uids))
        keyed = self._keyed_states(out)
        for u in uids:
            self._forget(u)
        return keyed

    def extract_state(self, uids: list[int]) -> dict[int, KVState]:
        uids = [u for u in uids if u not in self._unkeyed]
        out = {u: self._prefills[u].state(copied=True) for u in uids if u in self._prefills}
        out.update(self.text.extract_state(uids))
        return self._keyed_states(out)

    def _keyed_states(self, states: dict[int, KVState]) -> dict[int, KVState]:
        return {
            u: (cache, self._keyed(u, tokens))
            for u, (cache, tokens) in states.items()
            if u not in self._unkeyed
        }

    def _forget(self, uid: int) -> None:
        self._keys.pop(uid, None)
        self._unkeyed.discard(uid)

    def _keyed(self, uid: int, tokens: list[int]) -> list[int]:
        """A sequence's tokens as the prefix cache keys them."""
        key = self._keys.get(uid)
        if key is None:
            return tokens
        n = min(len(tokens), len(key))
        return key[:n] + list(tokens[n:])

    def reset(self) -> None:
        self._prefills.clear()
        self._keys.clear()
        self._unkeyed.clear()
        self.text.reset()

    def close(self) -> None:
        self._prefills.clear()
        self.text.close()

    def stats(self) -> dict[str, Any]:
        return {
            "mode": "batch",
            "vision_prefills": self.vision_prefills,
            "peak_batch": self.peak_batch,
            **self.text.stats(),
        }
