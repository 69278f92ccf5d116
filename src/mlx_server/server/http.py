"""Shared HTTP helpers: JSON body parsing, schema errors, SSE responses, disconnect watching."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from mlx_server.errors import InvalidRequest
from mlx_server.logs import log
from mlx_server.server.ignored_fields import note_ignored

M = TypeVar("M", bound=BaseModel)

SSE_HEADERS = {"Cache-Control": "no-cache", "Connection": "keep-alive", "X-Accel-Buffering": "no"}


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
        return schema.model_validate(obj)
    except ValidationError as e:
        raise InvalidRequest(describe_validation_error(e), param=_first_loc(e)) from e


# Deeper bodies than this are refused before anything recurses over them (validation, chat
# templates, JSON-schema compilers): no real request nests anywhere near it.
MAX_JSON_DEPTH = 100
_TOO_DEEP = f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels"
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_json_values(obj: Any) -> None:
    """Refuse bodies nested deeper than MAX_JSON_DEPTH and strings holding lone UTF-16
    surrogates (``"\\ud800"`` is valid JSON, but no text encoding can carry it), naming the
    field. Iterative, so a hostile body cannot exhaust the stack."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(obj, ())]
    while stack:
        value, path = stack.pop()
        if len(path) > MAX_JSON_DEPTH:
            raise InvalidRequest(_TOO_DEEP)
        if isinstance(value, str):
            if _SURROGATE.search(value):
                where = _loc(path) or "body"
                raise InvalidRequest(
                    f"{where}: the string holds a lone UTF-16 surrogate, which is not valid text",
                    param=where,
                )
        elif isinstance(value, dict):
            for k, v in value.items():
                if _SURROGATE.search(k):
                    where = _loc(path) or "body"
                    raise InvalidRequest(
                        f"{where}: a key holds a lone UTF-16 surrogate, which is not valid text",
                        param=where,
                    )
                stack.append((v, (*path, k)))
        elif isinstance(value, list):
            stack.extend((v, (*path, i)) for i, v in enumerate(value))


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


class EventStreamResponse(StreamingResponse):
    """A streaming response that notices a client leaving even while nothing is written.

    Starlette's own listens for the disconnect only under servers older than ASGI 2.4
    (newer ones make it wait for a write to fail), and a stream may write nothing for a
    long time (a long prompt's prefill). Here a disconnect always cancels the body
    iterator at once, and the generation's own cleanup frees its slot."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async with anyio.create_task_group() as group:

            async def stream() -> None:
                try:
                    await self.stream_response(send)
                except OSError:
                    pass  # the client went away while a frame was written
                group.cancel_scope.cancel()

            group.start_soon(stream)
            await self.listen_for_disconnect(receive)
            group.cancel_scope.cancel()


def sse_response(body: AsyncIterator[bytes]) -> StreamingResponse:
    return EventStreamResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)


T = TypeVar("T")


async def respond(
    request: Request,
    *,
    stream: AsyncIterator[bytes] | None,
    collect: Callable[[], Awaitable[dict[str, Any]]],
    cancel: Callable[[], None],
) -> Response:
    """Every generating route's ending: an SSE stream when ``stream`` is given, else the
    collected JSON answer; a client that leaves first cancels the generation (499)."""
    if stream is not None:
        return sse_response(stream)
    result = await until_disconnect(request, collect(), cancel)
    if result is None:
        log("Generation cancelled by client")
        return Response(status_code=499)
    return JSONResponse(result)


async def until_disconnect(request: Request, work: Awaitable[T], on_disconnect: Any) -> T | None:
    """Run ``work``; if the client disconnects first, call ``on_disconnect`` and return None."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        on_disconnect()
        try:
            await task
        except Exception:
            pass
        return None
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
