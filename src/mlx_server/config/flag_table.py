"""The flag table of docs/configuration.md, written from ``Settings``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mlx_server.config.options import env_name
from mlx_server.config.settings import settings_fields

# The flag table of docs/configuration.md is written from the declarations of ``Settings``, between
# these markers (``python -m mlx_server.config --write docs/configuration.md``); a test fails
# when the committed table differs from what this writes.
TABLE_START = "<!-- flags:start (python -m mlx_server.config --write docs/configuration.md) -->"
TABLE_END = "<!-- flags:end -->"


def _shown_default(f: Any) -> str:
    value = f.default
    if f.metadata.get("required"):
        return "required"
    if value is None or value == "":
        return "—"
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def flags_markdown() -> str:
    """Every option as a Markdown table: flags, environment variable, default, meaning."""
    rows = ["| Flag | Environment variable | Default | Meaning |", "|---|---|---|---|"]
    for f in settings_fields():
        meta = f.metadata
        flags = ", ".join(f"`{flag}`" for flag in meta["flags"])
        if meta.get("repeat"):
            flags += " (repeatable)"
        meaning = meta["help"]
        if "choices" in meta:
            meaning += "; one of " + ", ".join(f"`{c}`" for c in meta["choices"])
        cells = [flags, f"`{env_name(f.name)}`", _shown_default(f), _cell(meaning)]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows) + "\n"


def with_flag_table(document: str) -> str:
    """``document`` with the text between the table markers replaced by the current table."""
    start, end = document.index(TABLE_START), document.index(TABLE_END)
    head = document[: start + len(TABLE_START)]
    return head + "\n" + flags_markdown() + document[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mlx_server.config",
        description="Print the flag table in Markdown, or write it into a document between "
        "its markers.",
    )
    parser.add_argument("--markdown", action="store_true", help="print the table")
    parser.add_argument("--write", metavar="PATH", help="rewrite the table inside PATH")
    args = parser.parse_args(argv)
    if args.write:
        path = Path(args.write)
        path.write_text(with_flag_table(path.read_text()))
    if args.markdown or not args.write:
        print(flags_markdown(), end="")
    return 0
