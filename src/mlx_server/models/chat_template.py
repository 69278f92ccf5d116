"""A model's Jinja chat template, rendered the way its authors' reference code renders it.

The template sees what Hugging Face ``transformers``' ``apply_chat_template`` gives it:
``messages``, ``tools``, ``add_generation_prompt``, the tokenizer's special tokens
(``bos_token``, ``eos_token``, ...), the globals ``raise_exception`` and ``strftime_now``, a
``tojson`` filter that keeps non-ASCII text, ``{% break %}``/``{% continue %}``, and the
request's ``chat_template_kwargs``. Llama 3.x templates also read ``date_string``: it gets
today's date, as Meta's reference code and llama.cpp give it (the template's own default is a
fixed day in 2024).

Where templates disagree on a shape a request leaves open, each template is probed once at
load (``template_probe``) and given what it renders: tool-call ``arguments`` as an object
or as a JSON string (some concatenate the string, others iterate the object); the null
``content`` of an assistant turn that only calls tools where the template renders the calls
only then (DeepSeek R1); and polyfills for templates without a system or tool role, with
9-character call ids, bare tool objects or required descriptions.

A tokenizer with several named templates (``default``, ``tool_use``) gets ``tool_use`` when the
request offers tools, as ``transformers`` chooses.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from datetime import datetime, timezone
from functools import cache
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mlx_server.models.template_messages import prepare_messages
from mlx_server.models.template_probe import fill_descriptions, probe_template


class TemplateError(Exception):
    """The template refused or failed to render a conversation; the message says why."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters (<, >, &, ') and sorts keys: templates are
    # written against the json.dumps behaviour transformers gives them.
    if isinstance(value, Iterator):  # ``tools | map(attribute='function') | tojson``
        value = list(value)
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@cache
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@cache
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (cached per source text)."""
    return _environment().from_string(source)


# Message keys under which callers pass an assistant turn's reasoning; templates read
# ``reasoning_content`` (most) or ``thinking`` (gpt-oss), so both are given.
class ChatTemplate:
    """One model's chat template(s), with the caller-side facts probed from it."""

    def __init__(self, templates: dict[str, str], special_tokens: dict[str, Any]) -> None:
        """``templates``: name -> source; a single template is named ``default``."""
        if not templates:
            raise ValueError("no chat template")
        self.templates = templates
        self.special_tokens = special_tokens
        self.caps = probe_template(self._render_raw)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> ChatTemplate | None:
        """The template of an mlx-lm ``TokenizerWrapper`` or a Hugging Face tokenizer, or None
        when it has no Jinja template (or mlx-lm renders it with its own Python code)."""
        if getattr(tokenizer, "_chat_template", None) is not None:
            return None  # mlx-lm's chat_templates module renders this model
        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        raw = getattr(hf, "chat_template", None)
        if isinstance(raw, str) and raw:
            templates = {"default": raw}
        elif isinstance(raw, dict):
            templates = {k: v for k, v in raw.items() if isinstance(v, str) and v}
        else:
            return None
        if not templates:
            return None
        special = getattr(hf, "special_tokens_map", None) or {}
        return cls(templates, {k: v for k, v in special.items() if isinstance(v, str)})

    @property
    def text(self) -> str:
        """All template sources, for marker detection."""
        return "\n".join(self.templates.values())

    def source(self, tools: list[dict[str, Any]] | None) -> str:
        """The template to use: ``tool_use`` when tools are offered and there is one, else
        ``default``, else the only one."""
        if tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        return next(iter(self.templates.values()))

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """The rendered conversation; ``TemplateError`` when the template fails on it."""
        prepared = prepare_messages(messages, self.caps)
        if tools and self.caps.tool_descriptions:
            tools = [fill_descriptions(t) for t in tools]
        if tools and self.caps.flat_tools:
            tools = [t.get("function", t) for t in tools]
        return self._render_raw(
            prepared,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            template_kwargs=template_kwargs,
        )

    def _render_raw(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        source = self.source(tools)
        context: dict[str, Any] = dict(self.special_tokens)
        context.update(_caller_variables(source, tools))
        context.update(template_kwargs or {})
        context.update(_thinking_switch(source, template_kwargs or {}))
        messages = _thinking_marker(source, messages, template_kwargs or {})
        context.update(messages=messages, add_generation_prompt=add_generation_prompt)
        if tools:  # absent, not None: templates test ``tools is defined`` or loop over it
            context["tools"] = tools
        try:
            return compile_template(source).render(**context)
        except jinja2.exceptions.TemplateError as e:
            raise TemplateError(str(e) or type(e).__name__) from e
        except Exception as e:  # type errors and the like, inside the template's code
            raise TemplateError(f"{type(e).__name__}: {e}") from e


def _uses(source: str, name: str) -> bool:
    """Whether the template reads ``name`` as a variable (not a string or an attribute)."""
    pattern = rf"(?:{{{{|[+~(,]|\b(?:el)?if|\bnot)\s*{name}\b(?!\s*=)"
    return re.search(pattern, source) is not None


def _caller_variables(source: str, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Variables some templates expect their caller to set, given as the models' reference
    code gives them: Llama 3.x's ``date_string`` (its own default is a fixed day in 2024),
    FireFunction's ``functions`` (the tools as JSON) and ``datetime``. FireFunction's
    reference gives the time to the second in its system prompt; here it is the day (UTC,
    at midnight, in the same format): a system prompt that changed every second would
    never be served from the prefix cache (an agent's every turn re-prefilled)."""
    now = datetime.now()
    out: dict[str, Any] = {}
    if _uses(source, "date_string"):
        out["date_string"] = now.strftime("%d %b %Y")
    if _uses(source, "datetime"):
        out["datetime"] = datetime.now(timezone.utc).strftime("%b %d %Y 00:00:00 GMT")
    if _uses(source, "functions"):
        out["functions"] = json.dumps(tools, indent=2, ensure_ascii=False) if tools else ""
    return out


def _thinking_switch(source: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``enable_thinking`` (what the APIs set) under the name the template reads:
    ``thinking`` (Granite 3.x, DeepSeek V3.1), or ``thinking_budget: 0`` to turn Seed-OSS's
    thinking off. A name the caller set itself is left alone."""
    enable = kwargs.get("enable_thinking")
    if not isinstance(enable, bool) or _uses(source, "enable_thinking"):
        return {}
    out: dict[str, Any] = {}
    if "thinking" not in kwargs and _uses(source, "thinking"):
        out["thinking"] = enable
    if not enable and "thinking_budget" not in kwargs and _uses(source, "thinking_budget"):
        out["thinking_budget"] = 0
    return out


_NO_THINK = "/no_think"


def _thinking_marker(
    source: str, messages: list[dict[str, Any]], kwargs: dict[str, Any]
) -> list[dict[str, Any]]:
    """``enable_thinking: false`` for a template switched by a marker in the conversation
    (Nemotron Nano v2 reads ``/no_think`` in a system or user message, and removes it from
    the system prompt it renders): the marker goes at the end of the system message, unless
    the caller wrote a marker of its own."""
    if kwargs.get("enable_thinking") is not False or _uses(source, "enable_thinking"):
        return messages
    if f"'{_NO_THINK}'" not in source and f'"{_NO_THINK}"' not in source:
        return messages
    texts = [m.get("content") for m in messages if m.get("role") in ("system", "user")]
    if any(isinstance(t, str) and ("/think" in t or _NO_THINK in t) for t in texts):
        return messages
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        if not isinstance(first.get("content"), str):
            return messages
        content = f"{first['content']}\n{_NO_THINK}" if first["content"] else _NO_THINK
        return [{**first, "content": content}, *messages[1:]]
    return [{"role": "system", "content": _NO_THINK}, *messages]


def load_chat_template(tokenizer: Any) -> ChatTemplate | None:
    """``ChatTemplate.from_tokenizer``, or None (the tokenizer renders) when the template
    cannot even be compiled: such a model still loads, and its requests get the error."""
    try:
        return ChatTemplate.from_tokenizer(tokenizer)
    except jinja2.exceptions.TemplateError:
        return None
