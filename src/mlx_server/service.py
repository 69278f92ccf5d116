"""The chat service: neutral ChatRequest in, neutral output events out.

Both protocol layers call this; it renders the prompt, enforces the context size, submits to
the engine and runs the output parsers (reasoning split, tool calls) over the generated text.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from mlx_server.engine.handle import GenerationHandle, TokenPiece
from mlx_server.errors import ContextLengthExceeded, InvalidRequest
from mlx_server.events import Finished, Logprobs, OutputEvent, ToolCallStart
from mlx_server.logs import log
from mlx_server.models.prompt import encode_prompt, inline_tools, render_prompt, template_text
from mlx_server.models.system_turns import fold_late_system_messages, renders_system_in_place
from mlx_server.parsing.pipeline import OutputPipeline
from mlx_server.parsing.reasoning import prompt_opens_reasoning, reasoning_tags
from mlx_server.parsing.tools import resolve_tool_parser
from mlx_server.structured import constraint_spec
from mlx_server.types import ChatRequest, GenerationRequest

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
        engine: Any,
        *,
        ctx_size: int,
        tool_call_parser: str | None = None,
    ):
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.engine = engine
        self.ctx_size = ctx_size
        self.reasoning_tags = reasoning_tags(tokenizer) or ("<think>", "</think>")
        self.tool_format = resolve_tool_parser(tool_call_parser, tokenizer)
        if self.tool_format is None and tool_call_parser in (None, "auto"):
            # No format detected: Hermes-style <tool_call> JSON, the most common one, which
            # the prompt builder also describes to templates that don't render tools.
            self.tool_format = resolve_tool_parser("json_tools", tokenizer)
        self.template = template_text(tokenizer)
        self.constraints: Any = None  # a ConstraintCompiler, when structured output is available
        self.capabilities: list[str] = []
        # A VisionPromptBuilder for vision-language models: media parts in, image tokens out.
        self.vision: Any = None

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
        tools = chat.tools if chat.tool_choice != "none" else None
        messages = self.template_messages(chat)
        fmt = self.tool_format
        if fmt is not None and fmt.name == "json_tools":
            messages = inline_tools(messages, tools, self.template, (fmt.start, fmt.end))
        if self.vision is not None:
            messages = self.vision.template_messages(messages)
        return render_prompt(
            self.tokenizer, messages, tools=tools, template_kwargs=chat.template_kwargs
        )

    def count_tokens(self, chat: ChatRequest) -> int:
        return len(self._encode(chat, self.render(chat))[0])

    def _encode(self, chat: ChatRequest, text: str) -> tuple[list[int], Any]:
        """Token ids, and a vision model's inputs (image tokens counted in the ids)."""
        if self.vision is not None:
            return self.vision.encode(text, chat.messages)
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
        head = replace(chat, messages=[*messages[:n], {"role": "user", "content": ""}])
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

        Rendering and tokenizing a long prompt takes a while: it runs in a worker thread so
        the event loop (``/health``, other streams) never waits for it. Vision inputs are
        prepared on the loop's thread, as the processor may create MLX arrays.
        """
        request_id = request_id or f"chatcmpl-{uuid.uuid4().hex[:24]}"
        if self.vision is None:
            req, prepared = await asyncio.to_thread(self.build_request, chat, request_id)
        else:
            req, prepared = self.build_request(chat, request_id)
        return self.submit(chat, req, prepared)

    def build_request(
        self, chat: ChatRequest, request_id: str
    ) -> tuple[GenerationRequest, PreparedPrompt]:
        """Everything before the engine: prompt, context check, constraint, cache hints."""
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
        )
        return req, prepared

    def submit(
        self, chat: ChatRequest, req: GenerationRequest, prepared: PreparedPrompt
    ) -> Generation:
        """Queue a built request on the engine and attach the output parsers."""
        handle = self.engine.submit(req, asyncio.get_running_loop())
        parse_tools = (
            bool(chat.tools) and chat.tool_choice != "none" and self.tool_format is not None
        )
        pipeline = OutputPipeline(
            reasoning=self.reasoning_tags if chat.reasoning_format != "none" else None,
            start_in_reasoning=prepared.start_in_reasoning,
            tool_format=self.tool_format if parse_tools else None,
            tools=chat.tools if parse_tools else None,
            max_calls=None if chat.parallel_tool_calls else 1,
        )
        return Generation(req.request_id, handle, pipeline, len(prepared.tokens))

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

    @property
    def cached_tokens(self) -> int:
        return self.handle.cached_tokens

    def cancel(self) -> None:
        self.handle.cancel()

    async def events(self) -> AsyncIterator[StreamEvent]:
        saw_tools = False
        try:
            async for ev in self.handle:
                if isinstance(ev, TokenPiece):
                    if ev.logprobs:
                        yield Logprobs(ev.logprobs)
                    for out in self.pipeline.feed(ev.text):
                        saw_tools = saw_tools or isinstance(out, ToolCallStart)
                        yield out
                    continue
                for out in self.pipeline.flush():
                    saw_tools = saw_tools or isinstance(out, ToolCallStart)
                    yield out
                yield self._final(ev, saw_tools)
        finally:
            if not self.handle.done:
                self.handle.cancel()  # the consumer went away: free the slot

    def _final(self, ev: Finished, saw_tools: bool) -> Finished:
        reason = ev.reason
        in_reasoning = self.pipeline.in_reasoning
        if reason == "stop" and saw_tools:
            reason = "tool_calls"
        elif reason in ("stop", "stop_sequence") and in_reasoning:
            log("Generation ended inside the reasoning block: no answer was produced")
        if ev.error:
            log(f"Error during generation: {ev.error}")
        return replace(ev, reason=reason, in_reasoning=in_reasoning)
