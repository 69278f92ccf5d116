"""Flags of earlier Swift ``mlx-server`` versions, so launch scripts written for them keep
working: each maps onto a setting of ours where it has a meaning, else it is accepted and
logged as having no effect.

The Swift server's batching version (``MLXServerCommand.swift`` and ``README.md`` in Jan's
``mlx-server/``) declared ``--max-batch-size`` (0 = batching off), ``--batch-timeout-ms``
(default 100), ``--kv-block-size`` (default 16) as options with a value, and
``--enable-continuous-batching`` and ``--enable-prefix-caching`` as flags without one. The
two flags here also take an optional ``true``/``false`` so that a script can turn them off.
``--max-batch-size`` is one of our own settings (0 maps to one sequence at a time).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Any

from mlx_server.config import Settings

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _switch(value: str) -> bool:
    v = value.strip().lower()
    if v not in _TRUE | _FALSE:
        raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
    return v in _TRUE


def _non_negative(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0 (got {n})")
    return n


@dataclass(frozen=True)
class LegacyFlag:
    flag: str
    dest: str
    help: str
    switch: bool  # a flag with an optional true/false, else an option with an integer
    why_no_effect: str = ""

    @property
    def full_help(self) -> str:
        return f"{self.help} (no effect: {self.why_no_effect})" if self.why_no_effect else self.help


LEGACY_FLAGS = (
    LegacyFlag(
        "--batch-timeout-ms",
        "legacy_batch_timeout_ms",
        "Swift server's batch-filling wait",
        switch=False,
        why_no_effect="a new request joins the running batch at the next step",
    ),
    LegacyFlag(
        "--enable-continuous-batching",
        "legacy_continuous_batching",
        "Swift server's continuous batching",
        switch=True,
        why_no_effect="batching is always continuous",
    ),
    LegacyFlag(
        "--kv-block-size",
        "legacy_kv_block_size",
        "Swift server's KV block size",
        switch=False,
        why_no_effect="the KV cache is not paged in blocks",
    ),
    LegacyFlag(
        "--enable-prefix-caching",
        "legacy_prefix_caching",
        "Swift server's prefix caching (on by default here; false turns the prefix cache off, "
        "as --prompt-cache-size 0)",
        switch=True,
    ),
)


def add_legacy_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("flags of earlier Swift mlx-server versions")
    for f in LEGACY_FLAGS:
        kwargs: dict[str, Any] = {"dest": f.dest, "default": None, "help": f.full_help}
        if f.switch:
            kwargs.update(nargs="?", const=True, type=_switch, metavar="true|false")
        else:
            kwargs.update(type=_non_negative, metavar="N")
        group.add_argument(f.flag, **kwargs)


def pop_legacy(values: dict[str, Any]) -> dict[str, Any]:
    """Remove the legacy flags' values from parsed ``values``: {dest: value} of those given."""
    out = {}
    for f in LEGACY_FLAGS:
        value = values.pop(f.dest)
        if value is not None:
            out[f.dest] = value
    return out


def apply_legacy(settings: Settings, given: dict[str, Any]) -> tuple[Settings, list[str]]:
    """Settings with the legacy flags' meanings applied, and one log line per flag."""
    notes = []
    for f in LEGACY_FLAGS:
        if f.dest not in given:
            continue
        value = given[f.dest]
        shown = f"{f.flag} {str(value).lower()}"
        if f.dest == "legacy_prefix_caching" and value is False:
            settings = replace(settings, prompt_cache_size=0)
            notes.append(f"{shown}: prefix cache off")
        elif f.dest == "legacy_prefix_caching":
            notes.append(f"{shown}: no effect (the prefix cache is on by default)")
        else:
            notes.append(f"{shown}: no effect ({f.why_no_effect})")
    return settings, notes
