"""Shared HTTP helpers: JSON body parsing and schema errors that name the field, and the
opening every model route shares (the body, then the model it names, leased)."""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from mlx_server.errors import InvalidRequest
from mlx_server.server.ignored_fields import note_ignored

M = TypeVar("M", bound=BaseModel)
S = TypeVar("S")
# Leases the model a body names for a request: ``(request, name, keep_alive) -> model``
# (``Models.chat``, ``Models.encoder``); the lease is given back when the response has ended.
Lease = Callable[[Request, str | None, Any], Awaitable[S]]


async def parse_body(request: Request, schema: type[M]) -> M:
    """Read and validate a JSON body; every problem is an InvalidRequest naming it."""
    raw = await request.body()
    if not raw.strip():
        raise InvalidRequest("the request body is empty; send a JSON object")
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        ctype = request.headers.get("content-type", "")
        hint = f" (Content-Type was '{ctype}')" if ctype and "json" not in ctype else ""
        raise InvalidRequest(f"the request body is not valid JSON{hint}: {e}") from e
    except RecursionError as e:
        raise InvalidRequest(_TOO_DEEP) from e
    if not isinstance(obj, dict):
        raise InvalidRequest("the request body must be a JSON object")
    check_json_values(obj)
    note_ignored(request.scope, obj, schema)
    try:
        body = schema.model_validate(obj)
    except ValidationError as e:
        raise InvalidRequest(describe_validation_error(e), param=_first_loc(e)) from e
    return body


async def parse_and_lease(request: Request, schema: type[M], lease: Lease[S]) -> tuple[M, S]:
    """The body parsed as ``schema`` and the model its ``model`` names, leased by ``lease``
    with the body's ``keep_alive``. What refuses either reaches the app's handlers, which
    answer in the envelope of the route's protocol."""
    body = await parse_body(request, schema)
    model = await lease(request, getattr(body, "model", None), getattr(body, "keep_alive", None))
    return body, model


# Deeper bodies than this are refused before anything recurses over them (validation, chat
# templates, JSON-schema compilers): no real request nests anywhere near it.
MAX_JSON_DEPTH = 100
_TOO_DEEP = f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels"
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_json_values(obj: Any, where: str = "") -> None:
    """Refuse bodies nested deeper than MAX_JSON_DEPTH and strings holding lone UTF-16
    surrogates (``"\\ud800"`` is valid JSON, but no text encoding can carry it), naming the
    field. Iterative, so a hostile body cannot exhaust the stack. ``where``: the field that
    held ``obj`` as JSON text (a tool call's ``arguments``), named in place of the body."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(obj, ())]
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_JSON_DEPTH:
            if where:
                raise InvalidRequest(
                    f"{where} nests JSON deeper than {MAX_JSON_DEPTH} levels", param=where
                )
            raise InvalidRequest(_TOO_DEEP)
        if isinstance(value, str):
            if _SURROGATE.search(value):
                at = _within(where, path)
                raise InvalidRequest(
                    f"{at}: the string holds a lone UTF-16 surrogate, which is not valid text",
                    param=at,
                )
        elif isinstance(value, dict):
            for k, v in value.items():
                if _SURROGATE.search(k):
                    at = _within(where, path)
                    raise InvalidRequest(
                        f"{at}: a key holds a lone UTF-16 surrogate, which is not valid text",
                        param=at,
                    )
                stack.append((v, (*path, k)))
        elif isinstance(value, list):
            stack.extend((v, (*path, i)) for i, v in enumerate(value))


def _within(where: str, path: tuple[Any, ...]) -> str:
    """The field at ``path`` inside ``where`` (the body when empty)."""
    inner = _loc(path)
    if not where:
        return inner or "body"
    if not inner:
        return where
    return where + inner if inner.startswith("[") else f"{where}.{inner}"


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif (
            not isinstance(part, str)
            or part in {"str", "list[ContentPart]", "dict[str,any]"}
            or "[" in part
        ):
            continue  # pydantic's union-branch labels, not fields
        else:
            out += f".{part}" if out else part
    return out


def _first_loc(e: ValidationError) -> str | None:
    errs = e.errors()
    return _loc(errs[0]["loc"]) if errs else None


def describe_validation_error(e: ValidationError) -> str:
    """One readable line per problem, each naming the field."""
    seen: list[str] = []
    for err in e.errors():
        loc = _loc(err["loc"]) or "body"
        msg = f"{loc}: {err['msg']}"
        if err["type"] == "missing":
            msg = f"{loc}: field required"
        if msg not in seen:
            seen.append(msg)
    return "invalid request: " + "; ".join(seen[:5])
