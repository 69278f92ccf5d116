"""One model served across several ranks started by ``mlx.launch`` (MLX's distributed
backend: the ring over TCP, or MPI, NCCL, JACCL as the launcher sets them up).

Every rank runs this same program with the same flags. Each loads its share of the model
(``models.sharding``: pipeline or tensor parallel, mlx-lm's), then all meet at a barrier
that also tells each rank the others' process ids (``RankWatch``). Rank 0 serves HTTP and
owns scheduling; its engine runs in lockstep with the other ranks' (``engine.lockstep``),
which serve nothing and follow its journal until it says stop.

What runs sharded: text models with continuous batching, the prefix cache (RAM tier),
cancellation, structured output and tool calls, logprobs. What is refused at start, with
an error saying so: several models in one server, vision models, embedding and reranker
models, draft models and prompt lookup (speculative decoding), the quantized KV cache
(``--kv-bits``); the prefix cache's disk tier is turned off.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from mlx_server.boot.app import app_options, create_app
from mlx_server.boot.chat import load_chat_model
from mlx_server.boot.embedding import serves_embeddings
from mlx_server.boot.memory import set_cache_limit
from mlx_server.config import Settings
from mlx_server.engine.core.engine import EngineConfig
from mlx_server.engine.lockstep.channel import Channel
from mlx_server.engine.lockstep.follower import FollowerEngine
from mlx_server.engine.lockstep.leader import Lead
from mlx_server.engine.lockstep.watch import RankWatch, exchange_pids
from mlx_server.engine.runners.assembly import text_runner
from mlx_server.logs import load_failed, log, set_prefix
from mlx_server.models.base import ModelLoadError
from mlx_server.models.loader import load_model
from mlx_server.models.sharding import sharder
from mlx_server.server.metrics import Metrics


def launched_group() -> Any | None:
    """The group of ranks when this process was started by ``mlx.launch`` (or mpirun) with
    more than one rank; None otherwise (nothing is initialised then)."""
    if "MLX_RANK" not in os.environ and "OMPI_COMM_WORLD_SIZE" not in os.environ:
        return None
    if not mx.distributed.is_available():
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def refusal(settings: Settings, size: int) -> str | None:
    """Why these settings cannot be served across ranks, or None."""
    if settings.ranks > 1 and settings.ranks != size:
        return f"--ranks {settings.ranks}, but mlx.launch started {size} ranks"
    if settings.several_models:
        return "several models in one server cannot be served across ranks; serve one --model"
    if settings.draft_model or settings.prompt_lookup:
        return "speculative decoding (--draft-model, --prompt-lookup) does not run across ranks"
    if settings.kv_bits:
        return "the quantized KV cache (--kv-bits) does not run across ranks"
    try:
        if serves_embeddings(settings) is not None:
            return "embedding and reranker models cannot be served across ranks"
    except ModelLoadError:
        pass  # loading says what is wrong with the model
    return None


@dataclass
class Rank:
    """This process's place among the ranks, and what its loader and engine need."""

    settings: Settings
    group: Any
    watch: Any = field(default=None)

    @property
    def shard(self) -> Any:
        return sharder(self.settings.shard, self.group)

    def join(self) -> Any:
        """The barrier after loading (every rank has its share), then the watch starts."""
        peers = exchange_pids(self.group)
        log(f"Ranks: all {len(peers)} loaded (pids {', '.join(str(p) for _, p in peers)})")
        self.watch = RankWatch(self.group.rank(), peers, self.settings.rank_timeout_s)
        self.watch.start()
        return self.watch

    def lead(self) -> Any:
        """Rank 0: the engine's lockstep side (after the barrier)."""
        return Lead(Channel(self.group), self.join())


def announce(group: Any) -> None:
    rank, size = group.rank(), group.size()
    if rank:
        set_prefix(f"rank {rank}: ")
    log(f"Ranks: this is rank {rank} of {size}")


def build(settings: Settings, group: Any) -> tuple[Any, Any]:
    """Rank 0: load its share and return (app, engine), the engine in lockstep."""
    problem = refusal(settings, group.size())
    if problem:
        raise ValueError(problem)
    set_cache_limit(settings)
    metrics = Metrics()
    parts = load_chat_model(settings, Rank(settings, group), observer=metrics)
    if settings.prompt_cache_dir != "":
        log("Prompt cache: the disk tier is off across ranks (RAM tier only)")
    return create_app(parts.service, **app_options(settings), metrics=metrics), parts.engine


def follow(settings: Settings, group: Any) -> int:
    """A rank other than 0: load its share and follow rank 0 until it stops."""
    # Ctrl-C reaches every process of the terminal: rank 0 shuts down and says stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    problem = refusal(settings, group.size())
    if problem:
        return load_failed(problem)
    set_cache_limit(settings)
    rank = Rank(settings, group)
    try:
        loaded = load_model(
            settings.model,
            model_id=settings.model_id,
            dtype=settings.dtype,
            chat_template=settings.chat_template,
            shard=rank.shard,
        )
    except Exception as e:
        return load_failed(str(e) or type(e).__name__)
    channel = Channel(group)
    try:
        watch = rank.join()
        config = EngineConfig(**json.loads(channel.receive()))
    except Exception as e:  # rank 0 failed to start (it says why)
        return load_failed(f"rank 0 did not start: {type(e).__name__}: {e}")
    runner = text_runner(loaded.model, loaded.tokenizer, config)
    FollowerEngine(loaded.model, loaded.tokenizer, config, channel, watch, runner=runner).run()
    log("Ranks: rank 0 said stop")
    return 0
