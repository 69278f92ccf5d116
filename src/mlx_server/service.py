"""The chat service: neutral ChatRequest in, neutral output events out.

Both protocol layers call this; it renders the prompt, enforces the context size, submits to
the engine and runs the output parsers (reasoning split, tool calls) over the generated text.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from mlx_server.engine.handle import EngineEvent, GenerationHandle, Started, TokenPiece
from mlx_server.engine.protocol import EngineLike
from mlx_server.errors import ContextLengthExceeded, InvalidRequest
from mlx_server.events import Finished, Logprobs, OutputEvent
from mlx_server.logs import log
from mlx_server.models.chat_template import load_chat_template
from mlx_server.models.prompt import encode_prompt, inline_tools, render_prompt, template_text
from mlx_server.models.system_turns import fold_late_system_messages, renders_system_in_place
from mlx_server.parsing.functionary import is_functionary_v3_2
from mlx_server.parsing.harmony import is_harmony
from mlx_server.parsing.pipeline import OutputPipeline
from mlx_server.parsing.reasoning import prompt_opens_reasoning, reasoning_tags
from mlx_server.parsing.tools import resolve_tool_parser
from mlx_server.request_checks import check_logit_bias
from mlx_server.structured import constraint_spec
from mlx_server.types import ChatRequest, GenerationRequest

T = TypeVar("T")
StreamEvent = OutputEvent | Logprobs | Finished


@dataclass(frozen=True)
class PreparedPrompt:
    text: str
    tokens: list[int]
    max_tokens: int
    start_in_reasoning: bool
    vision_inputs: Any = None  # pixels etc. for a vision model's prompt with media


class ChatService:
    """Turns chat requests into generations on one engine and one model."""

    def __init__(
        self,
        model_id: str,
        tokenizer: Any,
        engine: EngineLike,
        *,
        ctx_size: int,
        tool_call_parser: str | None = None,
        constraints: Any = None,
        vision: Any = None,
        capabilities: list[str] | None = None,
    ):
        """``constraints``: a ConstraintCompiler when structured output is available;
        ``vision``: a VisionPromptBuilder for vision-language models (media parts in,
        image tokens out); ``capabilities``: what ``/v1/models`` lists (``["vision"]``)."""
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.engine = engine
        self.ctx_size = ctx_size
        self.tool_format = resolve_tool_parser(tool_call_parser, tokenizer)
        if self.tool_format is None and tool_call_parser in (None, "auto"):
            # No format detected: Hermes-style <tool_call> JSON, the most common one, which
            # the prompt builder also describes to templates that don't render tools.
            self.tool_format = resolve_tool_parser("json_tools", tokenizer)
        self.chat_template = load_chat_template(tokenizer)
        self.template = self.chat_template.text if self.chat_template else template_text(tokenizer)
        self.reasoning_tags = reasoning_tags(tokenizer, self.template) or ("<think>", "</think>")
        # gpt-oss (Harmony) and functionary v3.2 write addressed messages, not tagged text.
        self.message_format: str | None = None
        vocab = _vocab(tokenizer)
        # Added tokens included; 0 (no top_k check) for a tokenizer that can't say.
        self.vocab_size = len(vocab) if vocab else 0
        if is_harmony(self.template, vocab):
            self.message_format = "harmony"
        elif is_functionary_v3_2(self.template):
            self.message_format = "functionary_v3_2"
        if self.message_format and tool_call_parser in (None, "auto"):
            self.tool_format = None
        self.constraints = constraints
        self.capabilities = list(capabilities or [])
        self.vision = vision

    @property
    def harmony(self) -> bool:
        """The model writes OpenAI's Harmony format (gpt-oss)."""
        return self.message_format == "harmony"

    # ---- prompt ------------------------------------------------------------------------

    @functools.cached_property
    def system_in_place(self) -> bool:
        """Whether the chat template renders system messages after the first turn in place."""
        in_place = renders_system_in_place(self.tokenizer)
        if not in_place:
            log("Chat template takes a system message only first: later ones are folded into it")
        return in_place

    def template_messages(self, chat: ChatRequest) -> list[dict[str, Any]]:
        """The messages as the template gets them: later system messages folded if need be."""
        if self.system_in_place:
            return chat.messages
        return fold_late_system_messages(chat.messages)

    def render(self, chat: ChatRequest) -> str:
        tools = chat.tools if chat.tool_choice.mode != "none" else None
        messages = self.template_messages(chat)
        fmt = self.tool_format
        if fmt is not None and (fmt.name == "json_tools" or fmt.call_syntax):
            messages = inline_tools(
                messages, tools, self.template, (fmt.start, fmt.end), fmt.call_syntax
            )
        if self.vision is not None:
            messages = self.vision.template_messages(messages)
        return render_prompt(
            self.tokenizer,
            messages,
            tools=tools,
            template_kwargs=chat.template_kwargs,
            template=self.chat_template,
            add_generation_prompt=chat.add_generation_prompt,
            continue_final_message=chat.continue_final_message,
        )

    def count_tokens(self, chat: ChatRequest) -> int:
        """The rendered prompt's token count (image tokens included)."""
        return len(self._encode(chat, self.render(chat))[0])

    async def count(self, chat: ChatRequest) -> int:
        """``count_tokens`` for async handlers: a long prompt renders and tokenizes in a
        worker thread, so the event loop (``/health``, other streams) never waits for it."""
        return await asyncio.to_thread(self.count_tokens, chat)

    def _on_engine_thread(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine's thread (MLX arrays are made there only) and wait for
        it; an engine without one (the tests' scripted engine) runs it here."""
        call = getattr(self.engine, "call", None)
        return call(fn).result() if call is not None else fn()

    def _encode(self, chat: ChatRequest, text: str) -> tuple[list[int], Any]:
        """Token ids, and a vision model's inputs (image tokens counted in the ids)."""
        if self.vision is not None:
            return self.vision.encode(text, chat.messages, self._on_engine_thread)
        return encode_prompt(self.tokenizer, text), None

    def prepare(self, chat: ChatRequest) -> PreparedPrompt:
        """Render and tokenize; check prompt + max_tokens against the context size."""
        text = self.render(chat)
        tokens, vision_inputs = self._encode(chat, text)
        n = len(tokens)
        if chat.max_tokens is not None:
            if n + chat.max_tokens > self.ctx_size:
                raise ContextLengthExceeded(
                    f"this request needs {n + chat.max_tokens} tokens ({n} in the prompt + {chat.max_tokens} "
                    f"max_tokens), more than the context size of {self.ctx_size} tokens",
                    param="messages",
                )
            max_tokens = chat.max_tokens
        else:
            max_tokens = self.ctx_size - n
            if max_tokens <= 0:
                raise ContextLengthExceeded(
                    f"the prompt has {n} tokens, which leaves no room within the context size of "
                    f"{self.ctx_size} tokens",
                    param="messages",
                )
        start, end = self.reasoning_tags
        opens = chat.reasoning_format != "none" and prompt_opens_reasoning(text, start, end)
        return PreparedPrompt(text, tokens, max_tokens, opens, vision_inputs)

    def system_prefix_tokens(self, chat: ChatRequest, tokens: list[int]) -> int:
        """How many leading prompt tokens render the system prompt: the prefix the prompt
        shares with its system messages followed by an empty user turn. 0 if none."""
        messages = self.template_messages(chat)
        n = 0
        while n < len(messages) and messages[n].get("role") in ("system", "developer"):
            n += 1
        if n == len(messages) or self.vision is not None:
            return 0
        head = replace(
            chat,
            messages=[*messages[:n], {"role": "user", "content": ""}],
            add_generation_prompt=True,
            continue_final_message=False,
        )
        try:
            head_tokens = encode_prompt(self.tokenizer, self.render(head))
        except Exception:  # a template that rejects the cut conversation: no boundary
            return 0
        common = 0
        for a, b in zip(head_tokens, tokens, strict=False):
            if a != b:
                break
            common += 1
        return common if common < len(tokens) else 0

    # ---- generation --------------------------------------------------------------------

    async def start(self, chat: ChatRequest, request_id: str | None = None) -> Generation:
        """Validate, render and submit; raises InvalidRequest/Overloaded before anything streams.

        Rendering and tokenizing a long prompt, and fetching and decoding a vision prompt's
        media, take a while: they run in a worker thread so the event loop (``/health``,
        other streams) never waits for them. A vision model's processor, which makes MLX
        arrays, runs on the engine thread (``Engine.call``).
        """
        request_id = request_id or f"chatcmpl-{uuid.uuid4().hex[:24]}"
        req, prepared = await asyncio.to_thread(self.build_request, chat, request_id)
        return self.submit(chat, req, prepared)

    def build_request(
        self, chat: ChatRequest, request_id: str
    ) -> tuple[GenerationRequest, PreparedPrompt]:
        """Everything before the engine: prompt, context check, constraint, cache hints."""
        self.check_sampling(chat)
        prepared = self.prepare(chat)
        processors = self._constraint_processors(chat, prepared)
        req = GenerationRequest(
            request_id=request_id,
            prompt_tokens=prepared.tokens,
            max_tokens=prepared.max_tokens,
            sampling=chat.sampling,
            stop=chat.stop,
            logprobs=chat.logprobs,
            top_logprobs=chat.top_logprobs,
            logits_processors=tuple(processors),
            vision_inputs=prepared.vision_inputs,
            system_prefix_tokens=self.system_prefix_tokens(chat, prepared.tokens),
            ignore_eos=chat.ignore_eos,
        )
        return req, prepared

    def submit(
        self, chat: ChatRequest, req: GenerationRequest, prepared: PreparedPrompt
    ) -> Generation:
        """Queue a built request on the engine and attach the output parsers."""
        handle = self.engine.submit(req, asyncio.get_running_loop())
        messages = self.message_format
        if messages == "harmony" and chat.reasoning_format == "none":
            messages = None  # the raw text, channels and all
        parse_tools = (
            bool(chat.tools)
            and chat.tool_choice.mode != "none"
            and (self.tool_format is not None or messages is not None)
        )
        pipeline = OutputPipeline(
            reasoning=self.reasoning_tags if chat.reasoning_format != "none" else None,
            start_in_reasoning=prepared.start_in_reasoning,
            tool_format=self.tool_format if parse_tools else None,
            tools=chat.tools if parse_tools else None,
            max_calls=None if chat.parallel_tool_calls else 1,
            message_format=messages,
            content_markers=self.tool_format.content_markers if self.tool_format else (),
        )
        return Generation(req.request_id, handle, pipeline, len(prepared.tokens))

    def check_sampling(self, chat: ChatRequest) -> None:
        """Parameters that are valid in the protocol but not for this model."""
        top_k = chat.sampling.top_k
        if top_k and self.vocab_size and top_k >= self.vocab_size:
            raise InvalidRequest(
                f"top_k must be below the model's vocabulary size ({self.vocab_size}); got {top_k}",
                param="top_k",
            )
        check_logit_bias(chat.sampling, self.vocab_size)

    def _constraint_processors(self, chat: ChatRequest, prepared: PreparedPrompt) -> list[Any]:
        spec = constraint_spec(chat, self.tool_format if chat.tools else None)
        if spec is None:
            return []
        if self.constraints is None:
            raise InvalidRequest(
                "structured output is not available for this model", param="response_format"
            )
        activate_after = None
        if prepared.start_in_reasoning:
            activate_after = self.tokenizer.encode(self.reasoning_tags[1], add_special_tokens=False)
        try:
            return [self.constraints.processor(spec, activate_after=activate_after)]
        except ValueError as e:  # ConstraintError: a grammar llguidance rejects
            raise InvalidRequest(
                f"cannot enforce this request's constraint: {e}", param="response_format"
            ) from e


class Generation:
    """One running generation: iterate ``events()`` for neutral events, ending with Finished."""

    def __init__(
        self,
        request_id: str,
        handle: GenerationHandle,
        pipeline: OutputPipeline,
        prompt_tokens: int,
    ):
        self.request_id = request_id
        self.handle = handle
        self.pipeline = pipeline
        self.prompt_tokens = prompt_tokens
        self._start: Started | None = None
        self._early: list[EngineEvent] = []  # read while waiting for the start, not yet used

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the prefix cache covered (known once the generation started)."""
        return self._start.cached_tokens if self._start else self.handle.cached_tokens

    async def started(self) -> Started | None:
        """Wait until the engine takes the request up (it may queue first) and return its
        announcement, with the real cache split; None if it ended without starting."""
        while self._start is None and not self._early:
            try:
                ev = await self.handle.next_event()
            except BaseException:  # the consumer went away while the request waited
                self.handle.cancel()
                raise
            if isinstance(ev, Started):
                self._start = ev
            else:
                self._early.append(ev)
        return self._start

    async def _engine_events(self) -> AsyncIterator[EngineEvent]:
        while self._early:
            yield self._early.pop(0)
        if not self.handle.done:
            async for ev in self.handle:
                yield ev

    def cancel(self) -> None:
        self.handle.cancel()

    async def events(self) -> AsyncIterator[StreamEvent]:
        try:
            async for ev in self._engine_events():
                if isinstance(ev, Started):
                    self._start = self._start or ev
                    continue
                if isinstance(ev, TokenPiece):
                    if ev.logprobs:
                        yield Logprobs(ev.logprobs)
                    for out in self.pipeline.feed(ev.text):
                        yield out
                    continue
                for out in self.pipeline.flush():
                    yield out
                yield self._final(ev)
        finally:
            if not self.handle.done:
                self.handle.cancel()  # the consumer went away: free the slot

    def _final(self, ev: Finished) -> Finished:
        reason = ev.reason
        in_reasoning = self.pipeline.in_reasoning
        if reason == "stop" and self.pipeline.saw_tool_calls:
            reason = "tool_calls"
        elif reason in ("stop", "stop_sequence") and in_reasoning:
            log("Generation ended inside the reasoning block: no answer was produced")
        if ev.error:
            log(f"Error during generation: {ev.error}")
        return replace(ev, reason=reason, in_reasoning=in_reasoning)


def _vocab(tokenizer: Any) -> Any:
    try:
        return tokenizer.get_vocab()
    except Exception:  # a tokenizer without a vocabulary to show: trust the template
        return None
