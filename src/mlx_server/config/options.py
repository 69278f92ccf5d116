"""How an option is declared (default, help, flags, bounds) and what start-up checks of it."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def option(default: Any, help: str, *flags: str, **extra: Any) -> Any:
    """One option. ``extra``: ``required``, ``choices``, and bounds ``min`` / ``max``
    (inclusive) or ``above`` (exclusive), checked at start."""
    return field(default=default, metadata={"help": help, "flags": flags, **extra})


def env_name(name: str) -> str:
    return f"MLX_SERVER_{name.upper()}"


def check_bounds(name: str, value: Any, meta: Any) -> str | None:
    """Why ``value`` is out of the option's bounds, or None."""
    if value is None or isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if "min" in meta and value < meta["min"]:
        return f"must be at least {meta['min']} (got {value})"
    if "max" in meta and value > meta["max"]:
        return f"must be at most {meta['max']} (got {value})"
    if "above" in meta and value <= meta["above"]:
        return f"must be greater than {meta['above']} (got {value})"
    return None


def split_repeated(value: str) -> list[str]:
    """The values of a repeatable option: given several times, they arrive joined by newlines
    (an environment variable may hold several, one a line)."""
    return [v for v in value.split("\n") if v.strip()]
