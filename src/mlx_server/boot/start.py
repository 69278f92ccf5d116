"""Start-up: Settings to a served model. ``build`` dispatches to the chat, embedding,
several-models and sharded start-ups; ``start`` runs the whole sequence the command line
asks for (ranks, the bound socket, the log lines Jan's launcher reads, serving)."""

from __future__ import annotations

import gc
import sys
import time
from typing import Any

from mlx_server.boot import chat, embedding, several, sharded
from mlx_server.boot.app import app_options, create_app
from mlx_server.boot.memory import set_cache_limit
from mlx_server.boot.ranks import spawn
from mlx_server.boot.torchless import with_hint
from mlx_server.config import Settings
from mlx_server.logs import load_failed, log
from mlx_server.server.metrics import Metrics
from mlx_server.server.run import PortInUse, bind_socket, is_loopback, serve
from mlx_server.startup_report import START, compute_line


def build(settings: Settings, group: Any = None) -> tuple[Any, Any]:
    """Load what the settings serve and return (app, engine); the engine thread is started.
    ``group``: the ranks ``mlx.launch`` started, this process being rank 0."""
    if group is not None:
        return sharded.build(settings, group)
    if settings.several_models:  # a registry loads and unloads them on request
        return several.build(settings)
    if (encoder_dir := embedding.serves_embeddings(settings)) is not None:
        set_cache_limit(settings)
        encoder = embedding.load_embedding_model(settings, encoder_dir)
        return create_app(encoder.service, **app_options(settings)), encoder.engine
    set_cache_limit(settings)
    metrics = Metrics()
    # the readiness line Jan waits for: not held by kernel builds a first request meets anyway
    parts = chat.load_chat_model(settings, observer=metrics, ready_early=True)
    options = app_options(settings, vision=parts.vision)
    app = create_app(parts.service, **options, metrics=metrics)
    return app, parts.engine


def collect_again() -> None:
    """Garbage collection back on (``cli.main`` turns it off for the start), with what
    start-up made (the model, the modules), which lives as long as the server, kept out of
    every later collection: those then walk only what requests make. Start-up's own cyclic
    garbage is frozen with it, never freed (demo model: 1,347 small objects, 0.4 MB, no
    arrays), which costs less than the collection before the readiness line that would
    free it (0.13 s of CPU)."""
    gc.freeze()
    gc.enable()


def start(settings: Settings, notes: list[str], argv: list[str] | None = None) -> int:
    """Serve until shut down; returns the exit status. ``notes``: lines to log about the
    flags of an earlier Swift server; ``argv``: the flags, handed to each rank of ``--ranks``."""
    START.mark("imports")
    group = sharded.launched_group()  # started by mlx.launch with several ranks
    if group is None and settings.ranks > 1:
        if problem := sharded.refusal(settings, settings.ranks):
            return load_failed(problem)
        return spawn(settings.ranks, sys.argv[1:] if argv is None else argv)
    if group is not None:
        sharded.announce(group)
        if group.rank() != 0:
            collect_again()  # it loads, then follows rank 0 until shut down
            return sharded.follow(settings, group)
    log("MLX Server starting...")
    log(f"Model path: {settings.model}")
    log(f"Port: {settings.port}")
    log(f"Context size: {settings.ctx_size}")
    for note in notes:
        log(note)
    try:
        sock = bind_socket(settings.host, settings.port)
    except PortInUse as e:
        log(f"Error: {e}")
        print(f"Error: {e}", file=sys.stderr, flush=True)
        return 1
    if not is_loopback(settings.host) and not settings.api_key:
        log(
            f"WARNING: listening on {settings.host} (not a loopback address) WITHOUT an API key: anyone on the network can use this server. Pass --api-key."
        )
    log(compute_line())
    t0 = time.perf_counter()
    try:
        app, engine = build(settings, group)
    except Exception as e:  # ModelLoadError and anything the loaders raise
        sock.close()
        return load_failed(with_hint(str(e) or type(e).__name__))
    log(f"Model loaded in {time.perf_counter() - t0:.2f}s")
    START.mark("app")
    log(START.line())
    collect_again()
    serve(
        app,
        engine,
        sock,
        settings.host,
        settings.port,
        settings.log_level,
        settings.header_timeout_s,
    )
    return 0
