"""Rank 0's side of lockstep serving: the engine runs as ever, its runner is wrapped.

Every rank holds a share of the model and must compute every step together with rank 0, on
the same sequences, in the same order. Rank 0's engine decides everything (admission,
cancellation, stop strings, the prefix cache's evictions, each token); what changes the
runner or the prefix cache is written down as it happens, in order, and each step first
sends that journal to the other ranks (``channel``), which replay it on the same runner
and prefix-cache code (``follower``) before they step too. While idle, rank 0 sends an
empty journal every second: a heartbeat both sides watch (``watch``).

The journal's entries (JSON lists):

- ``["insert", uid, prompt, cached, system_end, alone, max_tokens, group, checkpoints]``: a
  sequence starts (``cached`` prompt tokens from the prefix cache; ``group``: its sampler's
  group; ``checkpoints``: where its prefill pauses besides ``system_end``);
- ``["remove", uids]``, ``["extract", uids]``: the runner's ``remove``/``extract_state``;
- ``["store", key, kind]``: the prefix cache keeps the KV state whose tokens hash to ``key``
  (the runner just gave it: a removed, extracted or finished sequence's);
- ``["evict", tokens]``: the prefix cache let the entry of ``tokens`` go;
- ``["reset"]``, ``["step"]``, ``["stop"]``.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from typing import Any

from mlx_server.engine.cache.prefix import PrefixCache
from mlx_server.engine.core.config import EngineConfig
from mlx_server.engine.lockstep.channel import Channel
from mlx_server.engine.lockstep.samplers import SamplerGroups, leading
from mlx_server.engine.lockstep.watch import RankWatch
from mlx_server.engine.runners.base import Insert, KVState, Progress, Response, Runner
from mlx_server.logs import log

HEARTBEAT_S = 1.0


def tokens_key(tokens: list[int]) -> str:
    """A short name for a token sequence that every rank computes the same."""
    import hashlib
    from array import array

    return hashlib.blake2b(array("q", tokens).tobytes(), digest_size=16).hexdigest()


class LeaderRunner:
    """The engine's runner on rank 0, journaling for the other ranks; see the module
    docstring."""

    def __init__(self, inner: Runner, channel: Channel, watch: RankWatch):
        self.inner = inner
        self._channel = channel
        self._watch = watch
        self._journal: list[list[Any]] = []
        self._samplers = SamplerGroups(lambda s: leading(channel.group, s))
        self._last_sent = time.monotonic()

    def note_cache(self, event: str, tokens: list[int], kind: str) -> None:
        """The prefix cache's ``on_change``: its stores and evictions, in order."""
        if event == "store":
            self._journal.append(["store", tokens_key(tokens), kind])
        else:
            self._journal.append(["evict", list(tokens)])

    def insert(self, job: Insert) -> None:
        sampler, group = self._samplers.join(job.uid, id(job.sampler), job.sampler)
        self._journal.append(
            [
                "insert",
                job.uid,
                list(job.prompt),
                job.cached,
                job.system_end,
                job.alone,
                job.request.max_tokens,
                group,
                list(job.checkpoints),
            ]
        )
        try:
            self.inner.insert(replace(job, sampler=sampler))
        except Exception:
            self._samplers.leave([job.uid])  # the other ranks fail it the same way
            raise

    def step(self) -> tuple[list[Progress], list[Response]]:
        with self._watch.section("a step"):
            self._journal.append(["step"])
            self._send()
            progress, responses = self.inner.step()
        self._samplers.leave([r.uid for r in responses if r.finish_reason is not None])
        return progress, responses

    def remove(self, uids: list[int]) -> dict[int, KVState]:
        self._journal.append(["remove", list(uids)])
        self._samplers.leave(uids)
        return self.inner.remove(uids)

    def extract_state(self, uids: list[int]) -> dict[int, KVState]:
        self._journal.append(["extract", list(uids)])
        return self.inner.extract_state(uids)

    def reset(self) -> None:
        self._journal.append(["reset"])
        self._samplers.clear()
        self.inner.reset()

    def close(self) -> None:
        """Tell the other ranks to stop (at shutdown; a rank already gone is no error)."""
        self._journal.append(["stop"])
        self._watch.stopping = True
        try:
            with self._watch.section("the last message"):
                self._send()
        except Exception as e:  # the ring is down: the other ranks stop on their own
            log(f"Ranks: could not tell the other ranks to stop: {e}")
        self.inner.close()

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()

    def heartbeat(self) -> None:
        """While idle: the journal so far, at least once a second."""
        if not self._journal and time.monotonic() - self._last_sent < HEARTBEAT_S:
            return
        with self._watch.section("a heartbeat"):
            self._send()

    def _send(self) -> None:
        journal, self._journal = self._journal, []
        self._channel.send(json.dumps(journal, separators=(",", ":")).encode())
        self._last_sent = time.monotonic()


def follower_settings(config: EngineConfig) -> dict[str, Any]:
    """The engine settings every rank's runner must share (from rank 0's EngineConfig)."""
    return {
        "max_batch_size": config.max_batch_size,
        "prefill_step_size": config.prefill_step_size,
        "prompt_cache_size": config.prompt_cache_size,
        "warm_up": config.warm_up,
        "solo": config.solo,
        "prefill_buckets": config.prefill_buckets,
    }


class Lead:
    """``EngineConfig.lockstep`` on rank 0: wraps the engine's runner and hears from it."""

    def __init__(self, channel: Channel, watch: RankWatch):
        self.channel = channel
        self.watch = watch
        self.runner: LeaderRunner | None = None

    def lead(
        self, runner: Runner, prefix_cache: PrefixCache | None, config: EngineConfig
    ) -> LeaderRunner:
        """Wrap the engine's runner; the other ranks get the engine's settings (``config``,
        an EngineConfig) first, so that their runners batch and prefill as this one does."""
        self.channel.send(json.dumps(follower_settings(config)).encode())
        self.runner = LeaderRunner(runner, self.channel, self.watch)
        if prefix_cache is not None:
            prefix_cache.on_change = self.runner.note_cache
        return self.runner

    def idle(self) -> None:
        if self.runner is not None:
            try:
                self.runner.heartbeat()
            except Exception as e:
                self.watch.failed("a heartbeat to the other ranks", e)

    def broken(self, error: BaseException) -> None:
        """A step failed: the ranks may no longer agree on what they compute, so serving
        stops (the watch ends the process)."""
        self.watch.failed("a step on rank 0", error)
