"""What a constrained answer must be (``ConstraintSpec``: JSON mode, a JSON schema, forced
tool calls), its validation, and the llguidance grammar it becomes (``build_grammar``).
``constraints.ConstraintCompiler`` compiles that grammar against a tokenizer."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

KINDS = ("json_object", "json_schema", "tool_call")

# JSON whitespace: at most one line break plus bounded indentation per gap, so a model
# cannot run away emitting blank lines or spaces while staying inside the grammar.
JSON_WHITESPACE = r"(?:[\x20\x09]{1,8}|\x0D?\x0A[\x20\x09]{0,48})"
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_pattern": JSON_WHITESPACE}


class ConstraintError(ValueError):
    """A schema, tool list or grammar that cannot be enforced; the message says why."""


@dataclass(frozen=True, eq=False)
class ConstraintSpec:
    """What a constrained answer must look like.

    - ``json_object``: any JSON object.
    - ``json_schema``: JSON matching ``schema``.
    - ``tool_call``: ``start`` + ``{"name": ..., "arguments": {...}}`` + ``end``, for one
      of ``tools`` (OpenAI function tools, or bare ``{"name", "parameters"}`` /
      ``{"name", "input_schema"}``), or only ``required_name`` when set. ``parallel``
      allows several calls in a row (separated by an optional newline).

    Equality and hashing follow ``key()``. Property order is part of the key because
    llguidance emits object properties in schema order.
    """

    kind: str
    schema: Mapping[str, Any] | None = None
    tools: Sequence[Mapping[str, Any]] = field(default_factory=tuple)
    required_name: str | None = None
    start: str = "<tool_call>"
    end: str = "</tool_call>"
    parallel: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConstraintError(f"unknown constraint kind {self.kind!r}; expected {KINDS}")
        if self.kind == "json_schema" and self.schema is None:
            raise ConstraintError("a json_schema constraint needs a schema")
        if self.kind == "tool_call" and not self.tools:
            raise ConstraintError("a tool_call constraint needs at least one tool")

    @classmethod
    def json_object(cls) -> ConstraintSpec:
        """Any JSON object (OpenAI ``response_format: {"type": "json_object"}``)."""
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any]) -> ConstraintSpec:
        """JSON matching ``schema`` (OpenAI ``response_format: json_schema``)."""
        return cls("json_schema", schema=schema)

    @classmethod
    def tool_call(
        cls,
        tools: Sequence[Mapping[str, Any]],
        required_name: str | None = None,
        *,
        start: str = "<tool_call>",
        end: str = "</tool_call>",
        parallel: bool = False,
    ) -> ConstraintSpec:
        """A call to one of ``tools`` (``tool_choice: "required"``) or to ``required_name``."""
        return cls("tool_call", None, tuple(tools), required_name, start, end, parallel)

    def key(self) -> str:
        """Canonical JSON of the spec: the grammar cache key."""
        body = {
            "kind": self.kind,
            "schema": self.schema,
            "tools": list(self.tools),
            "required_name": self.required_name,
            "start": self.start,
            "end": self.end,
            "parallel": self.parallel,
        }
        return json.dumps(body, separators=(",", ":"), ensure_ascii=False)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ConstraintSpec) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())


def validate_schema(schema: Any) -> None:
    """Raise ``ConstraintError`` unless ``schema`` is a valid JSON schema llguidance enforces.

    Checks the schema against its meta-schema (Draft 2020-12 unless ``$schema`` says
    otherwise), then compiles it, which names unsupported keywords (``uniqueItems``,
    ``not``, ``if``/``then``, ``propertyNames``, ``contains``, unknown ``format`` values,
    look-around in ``pattern``, ``oneOf`` that is not provably ``anyOf`` ...).
    """
    if not isinstance(schema, Mapping):
        raise ConstraintError(f"a JSON schema must be an object, not {type(schema).__name__}")
    _check_meta_schema(schema)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(dict(schema), defaults=_JSON_OPTIONS)
    raise_for_grammar_error(llguidance.LLMatcher.validate_grammar(grammar), "JSON schema")


_VALIDATED: OrderedDict[str, None] = OrderedDict()  # keys of specs found valid, newest last
_VALIDATED_SIZE = 256
_validated_lock = threading.Lock()


def validate_spec(spec: ConstraintSpec) -> None:
    """Validate everything a spec carries: its schema, or its tools and their parameters.

    A spec found valid is remembered (by its key, the last 256), so a burst of requests
    with one schema checks it once rather than once per request."""
    key = spec.key()
    with _validated_lock:
        if key in _VALIDATED:
            _VALIDATED.move_to_end(key)
            return
    _validate(spec)
    with _validated_lock:
        _VALIDATED[key] = None
        while len(_VALIDATED) > _VALIDATED_SIZE:
            _VALIDATED.popitem(last=False)


def _validate(spec: ConstraintSpec) -> None:
    if spec.kind == "json_schema":
        validate_schema(spec.schema)
    elif spec.kind == "tool_call":
        for name, params in _chosen_tools(spec):
            try:
                validate_schema(params)
            except ConstraintError as e:
                raise ConstraintError(f"tool {name!r} parameters: {e}") from None


def build_grammar(spec: ConstraintSpec, marker: Callable[[str], str] = json.dumps) -> str:
    """The llguidance grammar (JSON text) for ``spec``.

    ``marker`` renders a tool-call marker as a lark element; the compiler passes one that
    knows the tokenizer's special tokens.
    """
    if spec.kind == "json_object":
        schema: Mapping[str, Any] = {"type": "object"}
    elif spec.kind == "json_schema":
        schema = spec.schema or {}
    else:
        return llguidance.LLMatcher.grammar_from_lark(_tool_call_lark(spec, marker))
    return llguidance.LLMatcher.grammar_from_json_schema(dict(schema), defaults=_JSON_OPTIONS)


def _tool_call_lark(spec: ConstraintSpec, marker: Callable[[str], str]) -> str:
    bodies = [_call_schema(name, params, i) for i, (name, params) in enumerate(_chosen_tools(spec))]
    body = bodies[0] if len(bodies) == 1 else {"anyOf": bodies}
    body = {**body, "x-guidance": dict(_JSON_OPTIONS)}
    start = 'call ("\\n"? call)*' if spec.parallel else "call"
    return (
        f"start: {start}\n"
        f'call: {marker(spec.start)} "\\n"? body "\\n"? {marker(spec.end)}\n'
        f"body: %json {json.dumps(body)}\n"
    )


def _call_schema(name: str, params: Mapping[str, Any], index: int) -> dict[str, Any]:
    arguments = dict(params)
    # The parameters become a subschema; an $id keeps their "#/$defs/..." refs resolving
    # against themselves rather than against the wrapper.
    arguments.setdefault("$id", f"urn:mlx-server:tool:{index}")
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _chosen_tools(spec: ConstraintSpec) -> list[tuple[str, Mapping[str, Any]]]:
    """(name, parameters schema) of each tool the spec allows."""
    tools = [_function_of(tool) for tool in spec.tools]
    names = [name for name, _ in tools]
    if len(set(names)) != len(names):
        raise ConstraintError(f"tool names must be unique, got {names}")
    if spec.required_name is None:
        return tools
    chosen = [t for t in tools if t[0] == spec.required_name]
    if not chosen:
        raise ConstraintError(f"tool {spec.required_name!r} is not among the tools {names}")
    return chosen


def _function_of(tool: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    if tool.get("type", "function") != "function":
        raise ConstraintError(f"cannot constrain a call to a {tool.get('type')!r} tool")
    function = tool.get("function", tool)
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ConstraintError("every tool needs a name")
    params = function.get("parameters", function.get("input_schema")) or {"type": "object"}
    if not isinstance(params, Mapping):
        raise ConstraintError(f"tool {name!r} parameters must be a JSON schema object")
    return name, params


def _check_meta_schema(schema: Mapping[str, Any]) -> None:
    import jsonschema  # on the first schema: a tenth of a second of the server's start

    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise ConstraintError(f"invalid JSON schema at {where}: {e.message}") from None


def raise_for_grammar_error(message: str, what: str) -> None:
    """Raise ``ConstraintError`` with the gist of llguidance's ``message`` (none if empty)."""
    if not message:
        return
    # llguidance appends parser state and the grammar after the first lines; keep the gist.
    gist = message.split("\n<state>")[0].split("\n<grammar>")[0].strip()
    lines = [line for line in gist.splitlines() if line.strip()]
    raise ConstraintError(f"{what} cannot be enforced: {' '.join(lines[:4])}")
