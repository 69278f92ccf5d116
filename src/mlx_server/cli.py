"""Command line: flags → Settings, handed to start-up (``boot``). Jan-compatible flags."""

from __future__ import annotations

import argparse
import gc
import os
from collections.abc import Mapping
from dataclasses import MISSING
from typing import Any

from mlx_server import startup_report  # noqa: F401  (its clock times the imports to come)
from mlx_server.config import Settings, check_bounds, env_name, settings_fields
from mlx_server.legacy_flags import add_legacy_flags, apply_legacy, pop_legacy

# Jan hands its key to the server process in this variable too (tauri-plugin-mlx).
JAN_API_KEY_ENV = "MLX_API_KEY"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The flags, each defaulting to its ``MLX_SERVER_<NAME>`` environment variable."""
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(
        prog="mlx-server",
        description="MLX inference server with OpenAI- and Anthropic-compatible APIs. Every "
        "flag can also be set with its environment variable, MLX_SERVER_<NAME>.",
    )
    for f in settings_fields():
        meta = f.metadata
        env = env_name(f.name)
        kwargs: dict[str, Any] = {"help": f"{meta['help']} [env: {env}]", "dest": f.name}
        convert: Any = {"int": int, "int | None": int, "float": float, "float | None": float}.get(
            str(f.type), str
        )
        if f.type in ("bool", bool):
            kwargs["action"] = "store_true"
            convert = _flag
        elif meta.get("repeat"):  # every value kept; joined after parsing (_join_repeated)
            kwargs["action"] = "append"
        else:
            kwargs["type"] = convert
            if "choices" in meta:
                kwargs["choices"] = meta["choices"]
        if f.default is not MISSING:
            kwargs["default"] = f.default
        if meta.get("repeat"):
            # argparse appends to a list default: the flag's values are joined afterwards,
            # over the variable's, so that a flag still wins.
            kwargs["default"] = None
        elif env in environ:
            try:
                kwargs["default"] = convert(environ[env])
            except ValueError:
                parser.error(f"{env}: invalid value {environ[env]!r}")
        elif f.name == "api_key" and JAN_API_KEY_ENV in environ:
            kwargs["default"] = environ[JAN_API_KEY_ENV]
        elif meta.get("required") and not meta.get("repeat"):
            kwargs["required"] = True
        parser.add_argument(*meta["flags"], **kwargs)
    add_legacy_flags(parser)
    return parser


def _join_repeated(ns: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """A repeatable option's values, one a line (``Settings.model_paths``); the variable's
    when the flag was not given."""
    for f in settings_fields():
        if f.metadata.get("repeat"):
            given = getattr(ns, f.name)
            value = "\n".join(given) if given else environ.get(env_name(f.name), f.default)
            setattr(ns, f.name, value)


def _flag(value: str) -> bool:
    v = value.strip().lower()
    if v not in _TRUE | _FALSE:
        raise ValueError(value)
    return v in _TRUE


def parse_settings(
    argv: list[str] | None = None, environ: Mapping[str, str] | None = None
) -> Settings:
    """Flags (over ``MLX_SERVER_*`` environment variables) to checked Settings; a bad value
    prints usage and exits 2."""
    return parse_launch(argv, environ)[0]


def parse_launch(
    argv: list[str] | None = None,
    environ: Mapping[str, str] | None = None,
    *,
    torchless: bool = False,
) -> tuple[Settings, list[str]]:
    """``parse_settings``, and a line to log for each flag of an earlier Swift server.
    ``torchless`` (the server's own start): torch is hidden from this process when it serves
    one local text model (``boot/torchless.py``), before the checks below import mlx-lm."""
    parser = build_parser(environ)
    ns = parser.parse_args(argv)  # unknown flags: usage on stderr, exit 2
    legacy = pop_legacy(vars(ns))
    _join_repeated(ns, environ if environ is not None else os.environ)
    if not ns.model and not ns.models_dir:
        parser.error("the following arguments are required: -m/--model (or --models-dir)")
    hidden = None
    if torchless:
        from mlx_server.boot.torchless import keep_torch_out

        hidden = keep_torch_out(ns.model, ns.models_dir, environ)
    for f in settings_fields():
        problem = check_bounds(f.name, getattr(ns, f.name), f.metadata)
        if problem:
            parser.error(f"{f.metadata['flags'][-1]} {problem}")
    for f in settings_fields():  # choices given through the environment skip argparse's check
        value, choices = getattr(ns, f.name), f.metadata.get("choices")
        if choices and value is not None and value not in choices:
            parser.error(f"{f.metadata['flags'][-1]}: {value!r} is not one of {', '.join(choices)}")
    if ns.tool_call_parser is not None:
        from mlx_server.parsing.tool_formats import available_tool_parsers

        valid = ["auto", "none", *available_tool_parsers()]
        if ns.tool_call_parser not in valid:
            parser.error(
                f"--tool-call-parser: unknown format {ns.tool_call_parser!r}; valid: {', '.join(valid)}"
            )
    from mlx_server.engine.speculative.kinds import draft_kind_problem

    problem = draft_kind_problem(ns.draft_kind, ns.prompt_lookup, ns.draft_model)
    if problem:
        parser.error(problem)
    settings, notes = apply_legacy(Settings(**vars(ns)), legacy)
    return settings, notes if hidden is None else [*notes, hidden]


def main(argv: list[str] | None = None) -> int:
    settings, notes = parse_launch(argv, torchless=True)
    # Start-up (the imports, the model's load) makes many objects and little garbage, and
    # each full collection walks all of them: 0.3-0.5 s of a start on a CPU. Collection
    # comes back, with what start-up made kept out of it, before serving (``start``).
    gc.disable()
    try:
        # Imported here: --help and a bad flag answer without loading MLX or the app.
        from mlx_server.boot.start import start

        return start(settings, notes, argv)
    finally:
        gc.enable()
