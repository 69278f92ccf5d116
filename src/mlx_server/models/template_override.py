"""``--chat-template``: a template given at start that replaces the model's own.

The value is what Jan's chat-template setting holds (Jinja template text), a path to a
``.jinja`` file, or the name of one of the templates the model ships (``tool_use`` of a model
with named templates). It is installed on the tokenizer, so rendering, tool-call format
detection and the template probes all see it. A template that does not parse stops the start
with a ModelLoadError naming the problem.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2

from mlx_server.models.base import ModelLoadError
from mlx_server.models.chat_template import compile_template

_JINJA_MARKS = ("{{", "{%", "{#")


def resolve_override(value: str, bundled: str | dict[str, str] | None) -> str:
    """The template text ``value`` stands for; ModelLoadError when it names nothing or does
    not parse."""
    text = _source(value, bundled)
    try:
        compile_template(text)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ModelLoadError(
            f"--chat-template does not parse: {e.message} (line {e.lineno})"
        ) from e
    except jinja2.exceptions.TemplateError as e:
        raise ModelLoadError(f"--chat-template does not parse: {e}") from e
    return text


def _source(value: str, bundled: str | dict[str, str] | None) -> str:
    if isinstance(bundled, dict) and value in bundled:
        return bundled[value]
    if any(mark in value for mark in _JINJA_MARKS):
        return value
    path = Path(value).expanduser()
    if path.suffix == ".jinja" or path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except OSError as e:
            raise ModelLoadError(f"--chat-template: cannot read {path}: {e.strerror}") from e
    names = ", ".join(sorted(bundled)) if isinstance(bundled, dict) else "none"
    raise ModelLoadError(
        f"--chat-template {value!r} is neither Jinja template text, a .jinja file, nor a "
        f"template the model ships (its named templates: {names})"
    )


def install_chat_template(
    tokenizer: Any, bundled: str | dict[str, str] | None, override: str = ""
) -> None:
    """Put the model's template (``bundled``), or the ``override`` in its place, on an
    mlx-lm ``TokenizerWrapper``."""
    if override:
        tokenizer._tokenizer.chat_template = resolve_override(override, bundled)
        # mlx-lm renders some models with Python code of its own; the override replaces it.
        tokenizer._chat_template = None
        tokenizer.has_chat_template = True
    elif bundled is not None:
        tokenizer._tokenizer.chat_template = bundled
