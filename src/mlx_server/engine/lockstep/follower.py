"""The other ranks' side of lockstep serving: the same engine, driven by rank 0's journal.

A follower has the engine's runner and prefix cache (the same classes, set up the same way)
but no queue, no scheduler decisions and no clients: it replays rank 0's journal entry by
entry (see ``leader``) and steps when rank 0 steps. Its prefix cache keeps what rank 0's
keeps, this rank's share of each KV state, so a prompt that hits rank 0's cache hits here
by the same number of tokens; its limits are rank 0's to enforce (``["evict", ...]``).
"""

from __future__ import annotations

import json
from typing import Any

from mlx_server.engine.core.engine import Engine, EngineConfig
from mlx_server.engine.lockstep.channel import Channel
from mlx_server.engine.lockstep.leader import tokens_key
from mlx_server.engine.lockstep.samplers import SamplerGroups, following
from mlx_server.engine.lockstep.watch import RankWatch
from mlx_server.engine.runners.base import Insert, KVState, Runner
from mlx_server.logs import log
from mlx_server.types import GenerationRequest

# Limits rank 0 enforces for every rank (a follower never evicts on its own).
_UNBOUNDED = 1 << 62


class FollowerEngine(Engine):
    """An engine on a rank other than 0; ``run`` replays rank 0's journal until it stops."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        config: EngineConfig,
        channel: Channel,
        watch: RankWatch,
        *,
        runner: Runner,
    ):
        """``config``: rank 0's settings (``leader.follower_settings``); ``runner``: built
        from them as rank 0's was (``runners.assembly.text_runner``)."""
        size = _UNBOUNDED if config.prompt_cache_size > 0 else 0
        config = EngineConfig(
            max_batch_size=config.max_batch_size,
            max_queue=0,
            prefill_step_size=config.prefill_step_size,
            prompt_cache_size=size,
            prompt_cache_bytes=_UNBOUNDED,
            kv_budget_bytes=_UNBOUNDED,
            warm_up=config.warm_up,
            solo=config.solo,
            prefill_buckets=config.prefill_buckets,
        )
        super().__init__(model, tokenizer, config, runner=runner)
        if self._prompt_cache is not None:
            self._prompt_cache.on_insert = None  # no memory budget of its own either
        self._channel = channel
        self._watch = watch
        self._groups = SamplerGroups(lambda _: following(channel.group))
        self._states: dict[str, tuple[Any, list[int]]] = {}  # KV states the runner gave

    def run(self) -> None:
        """Replay the journal until rank 0 says stop (on the calling thread)."""
        self._warm_up()
        while True:
            with self._watch.section("rank 0's next message"):
                try:
                    journal = json.loads(self._channel.receive())
                except Exception as e:
                    self._watch.failed("waiting for rank 0", e)
                    return
            for entry in journal:
                if entry[0] == "stop":
                    self._watch.stopping = True
                    self._runner.close()
                    return
                with self._watch.section(f"{entry[0]} from rank 0"):
                    try:
                        self._replay(entry)
                    except Exception as e:
                        self._watch.failed(f"{entry[0]} from rank 0", e)

    def _warm_up_budget(self) -> float:
        return float("inf")  # every rank runs the same warm-up steps

    def _replay(self, entry: list[Any]) -> None:
        op, args = entry[0], entry[1:]
        runner = self._runner
        if op == "insert":
            self._insert(*args)
        elif op == "remove":
            self._groups.leave(args[0])
            self._keep_states(runner.remove(args[0]))
        elif op == "extract":
            self._keep_states(runner.extract_state(args[0]))
        elif op == "store":
            self._store(*args)
        elif op == "evict":
            if self._prompt_cache is not None:
                self._prompt_cache.forget(args[0])
        elif op == "reset":
            self._groups.clear()
            self._states.clear()
            runner.reset()
        elif op == "step":
            self._step_once()
        else:
            self._watch.lost(f"rank 0 sent an unknown entry {op!r}")

    def _insert(
        self,
        uid: int,
        prompt: list[int],
        cached: int,
        system_end: int,
        alone: bool,
        max_tokens: int,
        group: int,
        checkpoints: list[int],
    ) -> None:
        cache, rest = None, prompt
        if cached and self._prompt_cache is not None:
            cache, rest = self._prompt_cache.fetch(prompt)
        if len(prompt) - len(rest) != cached:
            self._watch.lost(
                f"the prefix caches disagree: rank 0 has {cached} tokens of a prompt, this "
                f"rank {len(prompt) - len(rest)}"
            )
        sampler, _ = self._groups.join(uid, group, None)
        request = GenerationRequest(f"rank0-{uid}", prompt, max_tokens)
        job = Insert(
            uid=uid,
            request=request,
            prompt=prompt,
            cached=cached,
            cache=cache,
            sampler=sampler,
            system_end=system_end,
            alone=alone,
            checkpoints=tuple(checkpoints),
        )
        try:
            self._runner.insert(job)
        except Exception as e:  # rank 0's insert failed the same way
            self._groups.leave([uid])
            log(f"Ranks: a sequence failed to start: {type(e).__name__}: {e}")

    def _step_once(self) -> None:
        self._states.clear()  # what rank 0 did not store by now, it will not
        _, responses = self._runner.step()
        for r in responses:
            if r.finish_reason is None:
                continue
            self._groups.leave([r.uid])
            if r.prompt_cache is not None and r.all_tokens is not None:
                self._states[tokens_key(r.all_tokens)] = (r.prompt_cache, r.all_tokens)

    def _keep_states(self, states: dict[int, KVState]) -> None:
        for cache, tokens in states.values():
            if cache is not None:
                self._states[tokens_key(list(tokens))] = (cache, list(tokens))

    def _store(self, key: str, kind: str) -> None:
        state = self._states.get(key)
        if state is None or self._prompt_cache is None:
            self._watch.lost("rank 0 stored a KV state this rank does not have")
            return
        self._prompt_cache.insert(state[1], state[0], kind)
