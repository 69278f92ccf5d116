"""Tool-call formats: mlx-lm's parser modules, chosen by name or detected from the tokenizer.

Each module in ``mlx_lm.tool_parsers`` describes one format with ``tool_call_start``,
``tool_call_end`` (empty when a call runs to the end of the output) and
``parse_tool_call(text, tools)``, which turns the text between the two markers into
``{"name", "arguments"}`` (or a list of them). ``ToolFormat`` carries those three, plus,
for formats whose arguments are a plain JSON object, the header pattern that lets the
arguments be streamed as they are generated. Formats mlx-lm lacks live in this package as
modules of the same shape (``llama3_json``).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import mlx_lm.tool_parsers
import regex

_JSON_HEADER = (
    r'\s*\{{\s*"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)"\s*,'
    r'\s*"(?:{keys})"\s*:\s*\{{'
)

# Formats whose arguments are a JSON object that follows a short header: the header
# pattern (matched with ``partial=True`` while it is still arriving) ends with the ``{``
# that opens the arguments; group ``name`` is the called function. The second item closes
# what the header opened around the arguments.
_STREAM_HEADERS = {
    # <tool_call>{"name": "f", "arguments": {...}}</tool_call>  (Hermes, Qwen 2.5/3)
    "json_tools": (_JSON_HEADER.format(keys="arguments|parameters"), "}"),
    # [TOOL_CALLS]f[ARGS]{...}  (Mistral Small 3.2, Devstral, Magistral)
    # The optional marker lets a call that follows another one repeat it.
    "mistral": (r"\s*(?:\[TOOL_CALLS\]\s*)?(?P<name>[\w.-]+)\s*\[ARGS\]\s*\{", ""),
    # {"name": "f", "parameters": {...}}; {...}  (Llama 3.1 / 3.2)
    "llama3_json": (r"\s*;?" + _JSON_HEADER.format(keys="parameters|arguments"), "}"),
}

# Formats of this package: name -> module.
_OWN_FORMATS = {
    "llama3_json": "mlx_server.parsing.llama3_json",
    **{
        name: f"mlx_server.parsing.formats.{name}"
        for name in (
            "apertus",
            "command_r_plus",
            "command_r7b",
            "deepseek",
            "firefunction_v2",
            "functionary_v3_1",
            "granite",
            "nemotron_v2",
            "phi4_mini",
            "seed_oss",
        )
    },
}
# Formats whose call may begin without its start marker, as a bare JSON object at the
# start of the answer.
_BARE_START = {"llama3_json"}

# Template markers of this package's formats, checked in order after mlx-lm's detection.
_TEMPLATE_MARKERS = (
    ("<｜tool▁calls▁begin｜>", "deepseek"),
    ("<|START_ACTION|>", "command_r7b"),
    ("<TOOLCALL>", "nemotron_v2"),
    ("<seed:tool_call>", "seed_oss"),
    ("<|/tool_call|>", "phi4_mini"),
    ("<|tool_call|>", "granite"),
    ("functools[", "firefunction_v2"),
    ("<|tools_prefix|>", "apertus"),
    (r"Action:\n```json", "command_r_plus"),  # as written in the Jinja string
    ("start with <function= and end with </function>", "functionary_v3_1"),
)

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
    return sorted(n for n in names | set(_OWN_FORMATS) if not n.startswith("_"))


def tool_format(name: str) -> ToolFormat:
    """The ``ToolFormat`` for a parser name; ``ValueError`` listing valid names if unknown."""
    valid = available_tool_parsers()
    if name not in valid:
        raise ValueError(
            f"unknown tool-call parser {name!r}; valid names: {', '.join(valid)} "
            f"(or {AUTO!r} to detect it from the chat template, {NONE!r} to disable)"
        )
    module = importlib.import_module(_OWN_FORMATS.get(name, f"mlx_lm.tool_parsers.{name}"))
    header, closer = _STREAM_HEADERS.get(name, (None, ""))
    return ToolFormat(
        name=name,
        start=module.tool_call_start,
        end=module.tool_call_end or "",
        parse=module.parse_tool_call,
        stream_header=regex.compile(header, regex.DOTALL) if header else None,
        stream_closer=closer,
        bare_start=name in _BARE_START,
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
    for marker, fmt in _TEMPLATE_MARKERS:
        if isinstance(template, str) and marker in template:
            return fmt
    if isinstance(template, str) and "<tool_call>" in template:
        return "json_tools"
    if isinstance(template, str) and (
        "<|python_tag|>" in template
        or ("<|start_header_id|>" in template and "ipython" in template)
    ):
        return "llama3_json"  # Llama 3.2 describes the JSON calls without <|python_tag|>
    return None


def _is_wrapper(tokenizer: object) -> bool:
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return isinstance(tokenizer, TokenizerWrapper)


def _known(name: str) -> str | None:
    return name if name in available_tool_parsers() else None
