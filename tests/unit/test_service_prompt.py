"""The chat service renders a request's prompt once: the system prompt's boundary (a
prefix-cache hint) is found in that one rendering, and a context error carries the measured
prompt so no protocol renders it again to word its message."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from scripted_engine import ScriptedEngine
from template_corpus import load_tokenizer, template_files, tokenizer_dir

from mlx_server.errors import ContextLengthExceeded
from mlx_server.models.prompt import encode_prompt
from mlx_server.service import ChatService, chat
from mlx_server.types import ChatRequest

SYSTEM = "You are a careful assistant. Answer briefly and cite your sources."
MESSAGES = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is the capital of France?"},
]


def two_render_boundary(service: ChatService, request: ChatRequest, tokens: list[int]) -> int:
    """The boundary as a second rendering finds it: the prompt's common prefix with its
    system messages followed by an empty user turn."""
    head = replace(request, messages=[*request.messages[:1], {"role": "user", "content": ""}])
    head_tokens = encode_prompt(service.tokenizer, service.render(head))
    common = 0
    for a, b in zip(head_tokens, tokens, strict=False):
        if a != b:
            break
        common += 1
    return common if common < len(tokens) else 0


@pytest.mark.parametrize("template", template_files(), ids=lambda p: p.stem)
def test_the_system_boundary_from_one_render(tmp_path_factory, template):
    tokenizer = load_tokenizer(tokenizer_dir(tmp_path_factory.mktemp("tok"), template))
    service = ChatService("m", tokenizer, ScriptedEngine(), ctx_size=4096)
    request = ChatRequest(list(MESSAGES))
    # Every template of the corpus takes a system + user conversation: a refusal fails.
    prepared = service.prepare(request)
    found = service.system_prefix_tokens(request, prepared)
    # At least as far as the two-render method reached (further where a template folds the
    # system prompt into the first user turn: the boundary is then that turn's content)...
    assert found >= two_render_boundary(service, request, prepared.tokens) > 0
    # ...and shared by another conversation with the same system prompt.
    other = ChatRequest([MESSAGES[0], {"role": "user", "content": "Name three rivers."}])
    assert service.prepare(other).tokens[:found] == prepared.tokens[:found]


def test_one_render_per_request_and_none_more_for_a_context_error(tiny_tokenizer, monkeypatch):
    calls = []
    real = chat.render_prompt
    monkeypatch.setattr(chat, "render_prompt", lambda *a, **k: calls.append(1) or real(*a, **k))
    service = ChatService("m", tiny_tokenizer, ScriptedEngine(), ctx_size=256)

    async def start(request: ChatRequest) -> None:
        gen = await service.start(request)
        async for _ in gen.events():
            pass

    asyncio.run(start(ChatRequest(list(MESSAGES), max_tokens=8)))
    assert len(calls) == 1
    calls.clear()
    with pytest.raises(ContextLengthExceeded) as err:
        asyncio.run(start(ChatRequest(list(MESSAGES), max_tokens=1000)))
    assert len(calls) == 1
    assert err.value.n_prompt_tokens > 0 and err.value.n_ctx == 256
    assert "max_tokens 1000" in str(err.value)
