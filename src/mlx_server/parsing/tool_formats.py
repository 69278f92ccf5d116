"""Tool-call formats: mlx-lm's parser modules, chosen by name or detected from the tokenizer.

Each module in ``mlx_lm.tool_parsers`` describes one format with ``tool_call_start``,
``tool_call_end`` (empty when a call runs to the end of the output) and
``parse_tool_call(text, tools)``, which turns the text between the two markers into
``{"name", "arguments"}`` (or a list of them). ``ToolFormat`` carries those three, plus,
for formats whose arguments are a plain JSON object, the header pattern that lets the
arguments be streamed as they are generated. Formats mlx-lm lacks, and what this package
adds to mlx-lm's (markers for detection, argument streaming), live in ``parsing.formats``
as modules of the same shape; a name found there is loaded from there.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from types import ModuleType
from typing import Any

import mlx_lm.tool_parsers
import regex

from mlx_server.parsing.formats import registered

# Parser names accepted besides the module names.
AUTO = "auto"
NONE = "none"


@dataclass(frozen=True)
class ToolFormat:
    """One tool-call format: its markers and the function that parses a call's text."""

    name: str
    start: str
    end: str
    parse: Callable[[str, Any], Any]
    # Compiled ``regex`` pattern of the header before a JSON arguments object, or None when
    # the arguments can only be produced once the whole call has been parsed.
    stream_header: Any = None
    # What closes the header's own brackets after the arguments (skipped, not parsed).
    stream_closer: str = ""
    # A call may also begin, without the start marker, as a bare JSON object at the very
    # start of the answer.
    bare_start: bool = False
    # How to write a call, for describing tools to templates that do not show them; empty:
    # a {"name", "arguments"} JSON object between the start and end markers.
    call_syntax: str = ""
    # Literal wrappers the model puts around its answer text, removed from the content.
    content_markers: tuple[str, ...] = ()

    @property
    def streams_arguments(self) -> bool:
        """Whether arguments are streamed piece by piece rather than at the call's end."""
        return self.stream_header is not None


@cache
def available_tool_parsers() -> list[str]:
    """Names of the tool-call parsers: mlx-lm's ``tool_parsers`` modules plus this package's."""
    names = {m.name for m in pkgutil.iter_modules(mlx_lm.tool_parsers.__path__)}
    own = {r.name for r in registered() if not r.writes_messages}
    return sorted(n for n in names | own if not n.startswith("_"))


def _module(name: str) -> ModuleType:
    for r in registered():
        if r.name == name:
            return r.module
    return importlib.import_module(f"mlx_lm.tool_parsers.{name}")


def tool_format(name: str) -> ToolFormat:
    """The ``ToolFormat`` for a parser name; ``ValueError`` listing valid names if unknown."""
    valid = available_tool_parsers()
    if name not in valid:
        raise ValueError(
            f"unknown tool-call parser {name!r}; valid names: {', '.join(valid)} "
            f"(or {AUTO!r} to detect it from the chat template, {NONE!r} to disable)"
        )
    module = _module(name)
    header = getattr(module, "stream_header", None)
    return ToolFormat(
        name=name,
        start=module.tool_call_start,
        end=module.tool_call_end or "",
        parse=module.parse_tool_call,
        stream_header=regex.compile(header, regex.DOTALL) if header else None,
        stream_closer=getattr(module, "stream_closer", ""),
        bare_start=getattr(module, "bare_start", False),
        call_syntax=getattr(module, "call_syntax", ""),
        content_markers=tuple(getattr(module, "content_markers", ())),
    )


def resolve_tool_parser(name: str | None, tokenizer: object) -> ToolFormat | None:
    """Choose the tool-call format for a model.

    ``name`` is an explicit choice (``--tool-call-parser``): a module name from
    ``available_tool_parsers()``, ``"none"`` (no tool parsing) or ``None``/``"auto"``
    (detect). Detection follows mlx-lm: the ``tool_parser_type`` of tokenizer_config.json,
    else markers in the chat template or vocabulary (``_infer_tool_parser``), else a
    template that writes ``<tool_call>`` is taken as the Hermes JSON format and one that
    knows ``<|python_tag|>`` as the Llama 3 JSON format.
    Returns None when the model has no known tool-call format.
    """
    if name is not None and name != AUTO:
        return None if name == NONE else tool_format(name)
    detected = detect_tool_parser(tokenizer)
    return tool_format(detected) if detected else None


def detect_tool_parser(tokenizer: object) -> str | None:
    """The parser name for a tokenizer (mlx-lm ``TokenizerWrapper`` or Hugging Face one)."""
    if tokenizer is None:
        return None
    # mlx-lm's load() records the parser it chose in the tokenizer's init kwargs.
    config = getattr(tokenizer, "init_kwargs", None)
    if isinstance(config, dict) and isinstance(config.get("tool_parser_type"), str):
        return _known(config["tool_parser_type"])
    parser = getattr(tokenizer, "tool_parser", None) if _is_wrapper(tokenizer) else None
    module = getattr(parser, "__module__", "") or ""
    if module.startswith("mlx_lm.tool_parsers."):
        return _known(module.rsplit(".", 1)[1])
    hf = getattr(tokenizer, "_tokenizer", None) if _is_wrapper(tokenizer) else tokenizer
    return _infer_from_template(hf)


def _infer_from_template(hf: Any) -> str | None:
    if hf is None or not hasattr(hf, "get_vocab"):
        return None
    from mlx_lm.tokenizer_utils import _infer_tool_parser

    try:
        name = _infer_tool_parser(hf)
    except Exception:  # an odd tokenizer must not stop the model from loading
        name = None
    if name:
        return _known(name)
    template = getattr(hf, "chat_template", None)
    if isinstance(template, dict):  # named templates, e.g. {"default": ..., "tool_use": ...}
        template = "\n".join(t for t in template.values() if isinstance(t, str))
    if not isinstance(template, str):
        return None
    for r in registered():
        if not r.writes_messages and r.matches(template, None):
            return r.name
    return None


def _is_wrapper(tokenizer: object) -> bool:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return isinstance(tokenizer, TokenizerWrapper)


def _known(name: str) -> str | None:
    return name if name in available_tool_parsers() else None
