"""The clients every tier's server tests use: the official SDKs pointed at a server, the
``data:`` lines of an SSE stream, and polling with a deadline."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from typing import Any

import anthropic
import openai


def _base_url(srv: Any) -> str:
    return srv if isinstance(srv, str) else srv.base_url


def openai_client(srv: Any, *, api_key: str = "x", strict: bool = True, **kw: Any) -> openai.OpenAI:
    """The OpenAI SDK on a server (anything with ``base_url``, or the URL itself): strict
    response validation (every field the server sends must parse) and no retries, so that a
    failure is the server's answer and not a retry's."""
    return openai.OpenAI(
        base_url=_base_url(srv) + "/v1",
        api_key=api_key,
        _strict_response_validation=strict,
        max_retries=0,
        **kw,
    )


def anthropic_client(
    srv: Any, *, api_key: str = "x", strict: bool = True, **kw: Any
) -> anthropic.Anthropic:
    """The Anthropic SDK on a server, strict and without retries (as ``openai_client``)."""
    return anthropic.Anthropic(
        base_url=_base_url(srv),
        api_key=api_key,
        _strict_response_validation=strict,
        max_retries=0,
        **kw,
    )


def sse_data(lines: Iterable[str]) -> list[dict]:
    """The JSON of each ``data:`` line of an SSE stream, the closing ``[DONE]`` left out."""
    return [
        json.loads(line[len("data: ") :])
        for line in lines
        if line.startswith("data: ") and line.strip() != "data: [DONE]"
    ]


def wait_until(
    condition: Callable[[], object],
    what: str = "the condition",
    timeout: float = 10.0,
    interval: float = 0.02,
) -> bool:
    """Poll ``condition`` until it holds; fail naming ``what`` once ``timeout`` seconds have
    passed. Returns True, so ``assert wait_until(...)`` reads as the check it is."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(interval)
    return True
