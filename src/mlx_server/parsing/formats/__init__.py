"""The output formats this package knows, one module each, all registered the same way.

A tool-call format has mlx-lm's ``tool_parsers`` module shape: a ``tool_call_start``
marker, a ``tool_call_end`` marker (empty: the call runs to the end of the output) and
``parse_tool_call(text, tools)`` for the text between them, returning ``{"name",
"arguments"}`` or a list of them; optionally ``stream_header``/``stream_closer`` (arguments
streamed as they arrive), ``bare_start``, ``call_syntax``, ``content_markers``. A message
format (Harmony, functionary v3.2) has a ``message_parser`` class instead. Each declares
how to recognise it: ``template_markers`` (groups of strings a chat template holds, any
group matching), ``vocab_markers`` and a ``priority`` (formats are tried highest first).
``parsing.detection`` reads this registry; a module without markers is only chosen by name.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import Any

from mlx_server.parsing.json_scan import loads


@dataclass(frozen=True)
class Registered:
    name: str
    module: ModuleType

    @property
    def writes_messages(self) -> bool:
        return hasattr(self.module, "message_parser")

    def matches(self, template: str, vocab: Any) -> bool:
        """Whether a chat template (and vocabulary, when known) write this format."""
        groups: tuple[tuple[str, ...], ...] = getattr(self.module, "template_markers", ())
        quoted = template.replace('"', "'")
        if not any(all(m in template or m in quoted for m in group) for group in groups):
            return False
        needed: tuple[str, ...] = getattr(self.module, "vocab_markers", ())
        return vocab is None or all(m in vocab for m in needed)


@cache
def registered() -> tuple[Registered, ...]:
    """Every format module, by descending detection priority."""
    found = []
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            found.append(Registered(info.name, importlib.import_module(f"{__name__}.{info.name}")))
    return tuple(sorted(found, key=lambda r: (-getattr(r.module, "priority", 0), r.name)))


def json_header(keys: str) -> str:
    """The header before a JSON arguments object in ``{"name": "f", "<keys>": {``: group
    ``name`` is the function; the pattern ends with the ``{`` that opens the arguments."""
    return (
        r'\s*\{\s*"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)"\s*,'
        r'\s*"(?:' + keys + r')"\s*:\s*\{'
    )


def json_calls(text: str, name_key: str = "name", args_key: str = "arguments") -> list[dict]:
    """A JSON list (or one object) of calls, with their name and arguments under the given
    keys, as ``{"name", "arguments"}`` dicts. Raises ValueError when it is not one."""
    value: Any = loads(text.strip())
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get(name_key), str):
            raise ValueError("not a tool call")
        args = item.get(args_key, item.get("parameters", {}))
        calls.append({"name": item[name_key], "arguments": args if args is not None else {}})
    if not calls:
        raise ValueError("no tool call")
    return calls
