"""llama.cpp's tokenizer endpoints: ``POST /tokenize`` and ``POST /detokenize``.

Same request and response shapes as llama.cpp's server, so its clients and tools work:
``{"content", "add_special" (false), "parse_special" (true), "with_pieces" (false)}`` →
``{"tokens": [ids]}`` or, with pieces, ``{"tokens": [{"id", "piece"}]}`` where a piece is
text, or its byte values when the token holds part of a UTF-8 character;
``{"tokens": [ids]}`` → ``{"content": text}``.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from mlx_server.models.text_prompt import check_token_ids
from mlx_server.registry.keep_alive import KeepAliveField
from mlx_server.registry.lease import Models
from mlx_server.server.http import parse_and_lease

_SPM_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # several models: whose tokenizer
    keep_alive: KeepAliveField = None


class TokenizeRequest(_Body):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(_Body):
    tokens: list[int]


def _byte_level_decoder(tokenizer: Any) -> dict[str, int] | None:
    """GPT-2 style byte-level BPE: the character → byte table of its vocabulary strings."""
    try:
        from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, _byte_decoder
    except ImportError:
        return None
    if not isinstance(tokenizer.detokenizer, BPEStreamingDetokenizer):
        return None
    return _byte_decoder()


def token_bytes(tokenizer: Any, token_id: int, byte_decoder: dict[str, int] | None) -> bytes:
    """The bytes one token stands for (partial UTF-8 characters included)."""
    name = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(name, str):
        if byte_decoder is not None and name and all(c in byte_decoder for c in name):
            return bytes(byte_decoder[c] for c in name)
        m = _SPM_BYTE.fullmatch(name)
        if m:  # SentencePiece byte fallback
            return bytes([int(m.group(1), 16)])
    return tokenizer.decode([token_id], skip_special_tokens=False).encode()


def piece(data: bytes) -> str | list[int]:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


def make_router(models: Models) -> APIRouter:
    """The two routes. The tokenizer runs on a worker thread (a body may hold megabytes of
    text or millions of ids), and so does the response's JSON, so that no other request
    waits for it."""
    router = APIRouter()

    @router.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        body, service = await parse_and_lease(request, TokenizeRequest, models.chat)
        return await asyncio.to_thread(_tokenize, service.tokenizer, body)

    @router.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        body, service = await parse_and_lease(request, DetokenizeRequest, models.chat)
        return await asyncio.to_thread(_detokenize, service.tokenizer, body)

    return router


def _tokenize(tokenizer: Any, body: TokenizeRequest) -> Response:
    kwargs: dict[str, Any] = {"add_special_tokens": body.add_special}
    if not body.parse_special:
        kwargs["split_special_tokens"] = True  # special-token text stays plain text
    ids = list(tokenizer.encode(body.content, **kwargs))
    if not body.with_pieces:
        return JSONResponse({"tokens": ids})
    decoder = _byte_level_decoder(tokenizer)
    pieces = [{"id": t, "piece": piece(token_bytes(tokenizer, t, decoder))} for t in ids]
    return JSONResponse({"tokens": pieces})


def _detokenize(tokenizer: Any, body: DetokenizeRequest) -> Response:
    ids = check_token_ids(tokenizer, body.tokens, "tokens")
    return JSONResponse({"content": tokenizer.decode(ids, skip_special_tokens=False)})
