"""Command line: flags → Settings → load the model → serve. Jan-compatible flags."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import MISSING
from typing import Any

from mlx_server.config import Settings, settings_fields
from mlx_server.logs import log


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlx-server",
        description="MLX inference server with OpenAI- and Anthropic-compatible APIs",
    )
    for f in settings_fields():
        meta = f.metadata
        kwargs: dict[str, Any] = {"help": meta["help"], "dest": f.name}
        if f.type in ("bool", bool):
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = {
                "int": int,
                "int | None": int,
                "float": float,
                "float | None": float,
            }.get(str(f.type), str)
            if "choices" in meta:
                kwargs["choices"] = meta["choices"]
            if meta.get("required"):
                kwargs["required"] = True
            elif f.default is not MISSING:
                kwargs["default"] = f.default
        parser.add_argument(*meta["flags"], **kwargs)
    return parser


def parse_settings(argv: list[str] | None = None) -> Settings:
    parser = build_parser()
    ns = parser.parse_args(argv)  # unknown flags: usage on stderr, exit 2
    if ns.tool_call_parser is not None:
        from mlx_server.parsing.tool_formats import available_tool_parsers

        valid = ["auto", "none", *available_tool_parsers()]
        if ns.tool_call_parser not in valid:
            parser.error(
                f"--tool-call-parser: unknown format {ns.tool_call_parser!r}; valid: {', '.join(valid)}"
            )
    return Settings(**vars(ns))


def _fail(message: str) -> int:
    log(f"Failed to load model: {message}")
    print(f"Error: {message}", file=sys.stderr, flush=True)
    return 1


def main(argv: list[str] | None = None) -> int:
    settings = parse_settings(argv)
    log("MLX Server starting...")
    log(f"Model path: {settings.model}")
    log(f"Port: {settings.port}")
    log(f"Context size: {settings.ctx_size}")
    if settings.ctx_size <= 0:
        print("Error: --ctx-size must be positive", file=sys.stderr)
        return 2

    from mlx_server.server.run import PortInUse, bind_socket, is_loopback

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

    from mlx_server.wiring import build

    t0 = time.perf_counter()
    try:
        app, engine = build(settings)
    except Exception as e:  # ModelLoadError and anything the loaders raise
        sock.close()
        return _fail(str(e) or type(e).__name__)
    log(f"Model loaded in {time.perf_counter() - t0:.2f}s")

    from mlx_server.server.run import serve

    serve(app, engine, sock, settings.host, settings.port, settings.log_level)
    return 0
