"""Shared HTTP helpers: JSON body parsing, schema errors, SSE responses, disconnect watching."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError

from mlx_server.errors import InvalidRequest

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
    if not isinstance(obj, dict):
        raise InvalidRequest("the request body must be a JSON object")
    try:
        return schema.model_validate(obj)
    except ValidationError as e:
        raise InvalidRequest(describe_validation_error(e), param=_first_loc(e)) from e


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


def sse_response(body: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)


T = TypeVar("T")


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
