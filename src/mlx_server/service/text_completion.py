"""Text completion: raw prompts (no chat template) through the same engine as chat.

A prompt is text, token ids, or text plus a suffix for fill-in-the-middle. Several prompts
are a batch: each becomes its own engine request, and all of them decode together in the
engine's continuous batch. The engine requests share one request id, so ``/v1/cancel`` with
that id stops the whole batch.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from mlx_server.errors import ContextLengthExceeded, InvalidRequest
from mlx_server.models.text_prompt import (
    check_token_ids,
    encode_text,
    fim_prompt,
    find_fim_tokens,
    missing_fim_message,
)
from mlx_server.parsing.pipeline import OutputPipeline
from mlx_server.service.chat import ChatService, Tokenizer
from mlx_server.service.generation import Generation, check_sampling, submit
from mlx_server.service.structured import format_spec
from mlx_server.types import GenerationRequest, SamplingParams

PromptInput = str | list[int]


@dataclass(frozen=True)
class TextPrompt:
    tokens: list[int]
    text: str  # the prompt as text, for ``echo``


@dataclass(frozen=True)
class CompletionOptions:
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    top_logprobs: int | None = None  # None: no logprobs
    ignore_eos: bool = False
    # the text must be JSON (``json_object``) or match a schema (``json_schema``): the
    # chat path's grammar, without a template (Ollama's raw ``/api/generate`` with ``format``)
    response_format: dict[str, Any] | None = None


class CompletionService:
    """Raw-text generations on a chat service's engine, tokenizer and context size (one
    per request: it keeps nothing of its own)."""

    def __init__(self, chat: ChatService):
        self.chat = chat

    @property
    def tokenizer(self) -> Tokenizer:
        return self.chat.tokenizer

    def fim_tokens(self) -> Any:
        return find_fim_tokens(self.tokenizer)  # the vocabulary is read once per tokenizer

    def build_prompt(self, i: int, prompt: PromptInput, suffix: str | None) -> TextPrompt:
        """Token ids for one prompt (raises InvalidRequest naming it)."""
        param = f"prompt[{i}]"
        if isinstance(prompt, list):
            ids = check_token_ids(self.tokenizer, prompt, param)
            text = self.tokenizer.decode(ids)
        else:
            ids, text = [], prompt
        if suffix is not None:
            fim = self.fim_tokens()
            if fim is None:
                raise InvalidRequest(missing_fim_message(), param="suffix")
            tokens = fim_prompt(
                self.tokenizer, fim, ids if isinstance(prompt, list) else text, suffix
            )
        elif isinstance(prompt, list):
            tokens = ids
        else:
            tokens = encode_text(self.tokenizer, text)
        if not tokens:
            raise InvalidRequest(f"{param} is empty: it encodes to no tokens", param="prompt")
        return TextPrompt(tokens, text)

    def check_context(self, prompts: list[TextPrompt], max_tokens: int) -> None:
        ctx = self.chat.ctx_size
        for i, p in enumerate(prompts):
            n = len(p.tokens)
            if n + max_tokens > ctx:
                raise ContextLengthExceeded.overflow(
                    n, max_tokens, ctx, param="prompt", subject=f"prompt[{i}]"
                )

    async def prepare(
        self, prompts: list[PromptInput], suffix: str | None, max_tokens: int
    ) -> list[TextPrompt]:
        """Tokenize (in a worker thread: long prompts take a while) and check the context."""

        def build() -> list[TextPrompt]:
            out = [self.build_prompt(i, p, suffix) for i, p in enumerate(prompts)]
            self.check_context(out, max_tokens)
            return out

        return await asyncio.to_thread(build)

    async def grammars(self, opts: CompletionOptions, n: int) -> list[tuple[Any, ...]]:
        """``build_grammars`` on a worker thread (a schema's first compile takes a while)."""
        if opts.response_format is None:
            return [()] * n
        return await asyncio.to_thread(self.build_grammars, opts, n)

    def build_grammars(self, opts: CompletionOptions, n: int) -> list[tuple[Any, ...]]:
        """Each of ``n`` prompts' own grammar processor for the options' ``response_format``
        (none without one); InvalidRequest for what cannot be enforced."""
        if opts.response_format is None:
            return [()] * n
        spec = format_spec(opts.response_format)
        return [tuple(self.chat.grammar_processors(spec)) for _ in range(n)]

    def start(
        self,
        prompts: list[TextPrompt],
        opts: CompletionOptions,
        request_id: str,
        grammars: list[tuple[Any, ...]] | None = None,
    ) -> list[Generation]:
        """Submit every prompt; if one is refused (queue full), cancel the others and raise.
        ``grammars``: each prompt's processors, built (``grammars``) or to build here."""
        check_sampling(opts.sampling, self.chat.vocab_size)
        if grammars is None:
            grammars = self.build_grammars(opts, len(prompts))
        gens: list[Generation] = []
        try:
            for p, grammar in zip(prompts, grammars, strict=True):
                req = GenerationRequest(
                    request_id=request_id,
                    prompt_tokens=p.tokens,
                    max_tokens=opts.max_tokens,
                    sampling=opts.sampling,
                    stop=opts.stop,
                    logprobs=opts.top_logprobs is not None,
                    top_logprobs=opts.top_logprobs or 0,
                    ignore_eos=opts.ignore_eos,
                    continues_text=True,
                    logits_processors=grammar,
                )
                # Raw text: no reasoning split, no tool calls.
                pipeline = OutputPipeline(
                    reasoning=None, start_in_reasoning=False, tool_format=None, tools=None
                )
                gens.append(submit(self.chat.engine, req, pipeline))
        except BaseException:
            for g in gens:
                g.cancel()
            raise
        return gens
