"""The chat service: neutral ChatRequest in, neutral output events out.

Both protocol layers call this; it renders the prompt, enforces the context size, submits to
the engine and runs the output parsers (reasoning split, tool calls) over the generated text.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from mlx_server.engine.core.protocol import ChatEngine
from mlx_server.errors import InvalidRequest
from mlx_server.logs import log
from mlx_server.models.chat_template import load_chat_template
from mlx_server.models.media_key import CACHE_TOKENS
from mlx_server.models.prompt import encode_prompt, inline_tools, render_prompt, template_text
from mlx_server.models.system_turns import fold_late_system_messages, renders_system_in_place
from mlx_server.parsing.detection import detect_output_format
from mlx_server.parsing.pipeline import OutputPipeline
from mlx_server.parsing.reasoning import prompt_opens_reasoning, reasoning_tags
from mlx_server.request_checks import check_text_only
from mlx_server.service.generation import Generation, check_sampling, submit
from mlx_server.service.history import history_end
from mlx_server.service.prompt import PreparedPrompt, answer_budget, system_prefix_tokens
from mlx_server.service.structured import constraint_spec
from mlx_server.types import ChatRequest, GenerationRequest

if TYPE_CHECKING:
    from mlx_server.engine.grammar.constraints import ConstraintCompiler
    from mlx_server.engine.grammar.spec import ConstraintSpec
    from mlx_server.models.vision import VisionPromptBuilder

T = TypeVar("T")


class Tokenizer(Protocol):
    """What the services use of a model's tokenizer (mlx-lm's ``TokenizerWrapper``)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int], **kwargs: Any) -> str: ...


class ChatService:
    """Turns chat requests into generations on one engine and one model."""

    def __init__(
        self,
        model_id: str,
        tokenizer: Tokenizer,
        engine: ChatEngine,
        *,
        ctx_size: int,
        tool_call_parser: str | None = None,
        constraints: ConstraintCompiler | None = None,
        vision: VisionPromptBuilder | None = None,
        capabilities: list[str] | None = None,
        trained_ctx: int | None = None,
        history_ends: bool = False,
    ):
        """``constraints``: a ConstraintCompiler when structured output is available;
        ``vision``: a VisionPromptBuilder for vision-language models (media parts in,
        image tokens out); ``capabilities``: what ``/v1/models`` lists (``["vision"]``);
        ``trained_ctx``: the model's trained maximum context, from its config;
        ``history_ends``: tell the engine where each prompt's history ends (an engine that
        keeps checkpoints of a cache it cannot rewind keeps one there)."""
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.engine = engine
        self.ctx_size = ctx_size
        self.trained_ctx = trained_ctx
        self.chat_template = load_chat_template(tokenizer)
        self.template = self.chat_template.text if self.chat_template else template_text(tokenizer)
        vocab = _vocab(tokenizer)  # once: a large vocabulary takes a tenth of a second
        tags = reasoning_tags(tokenizer, self.template, vocab)
        self.reasoning_tags = tags or ("<think>", "</think>")
        # Added tokens included; 0 (no top_k check) for a tokenizer that can't say.
        self.vocab_size = len(vocab) if vocab else 0
        # gpt-oss (Harmony) and functionary v3.2 write addressed messages, not tagged text.
        output = detect_output_format(tokenizer, self.template, vocab, tool_call_parser)
        self.tool_format = output.tools
        self.message_format = output.messages
        self.constraints = constraints
        self.capabilities = list(capabilities or [])
        self.vision = vision
        self.history_ends = history_ends

    def context_info(self) -> dict[str, Any]:
        """The context the server enforces and the model's trained maximum, under the names
        clients read: LM Studio's ``max_context_length``, llama.cpp's ``n_ctx`` and
        ``n_ctx_train`` (``/v1/models`` and ``/health`` both report them)."""
        trained = self.trained_ctx
        return {
            "context_length": self.ctx_size,
            "max_context_length": trained,
            "meta": {"n_ctx": self.ctx_size, "n_ctx_train": trained},
        }

    @property
    def harmony(self) -> bool:
        """The model writes OpenAI's Harmony format (gpt-oss)."""
        return self.message_format == "harmony"

    # ---- prompt ------------------------------------------------------------------------

    @functools.cached_property
    def system_in_place(self) -> bool:
        """Whether the chat template renders system messages after the first turn in place."""
        in_place = renders_system_in_place(self.tokenizer, self.chat_template)
        if not in_place:
            log("Chat template takes a system message only first: later ones are folded into it")
        return in_place

    def prepare_template(self) -> None:
        """Probe the chat template ahead of the first request (in the engine's idle time): a
        render of the probe conversation (1-3 ms for a large template), and where the
        tokenizer renders (no template of the server's own), its first compile of the
        template (tens of milliseconds), which later renders reuse."""
        _ = self.system_in_place

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
        it (an engine without a thread of its own runs it at once)."""
        return self.engine.call(fn).result()

    def _encode(self, chat: ChatRequest, text: str) -> tuple[list[int], dict[str, Any] | None]:
        """Token ids, and a vision model's inputs (image tokens counted in the ids)."""
        if self.vision is not None:
            return self.vision.encode(text, chat.messages, self._on_engine_thread)
        return encode_prompt(self.tokenizer, text), None

    def prepare(self, chat: ChatRequest) -> PreparedPrompt:
        """Render and tokenize; check prompt + max_tokens against the context size."""
        if self.vision is None:
            check_text_only(chat, self.model_id)
        text = self.render(chat)
        tokens, vision_inputs = self._encode(chat, text)
        max_tokens = answer_budget(len(tokens), chat.max_tokens, self.ctx_size)
        start, end = self.reasoning_tags
        opens = chat.reasoning_format != "none" and prompt_opens_reasoning(text, start, end)
        return PreparedPrompt(text, tokens, max_tokens, opens, vision_inputs)

    def system_prefix_tokens(self, chat: ChatRequest, prepared: PreparedPrompt) -> int:
        """Where the system prompt ends in the prompt's tokens (``prompt.system_prefix_tokens``)."""
        media = self.vision.placeholders if self.vision is not None else ()
        return system_prefix_tokens(self.tokenizer, self.template_messages(chat), prepared, media)

    def history_end(self, chat: ChatRequest, prepared: PreparedPrompt) -> int:
        """Where the prompt's history ends, for an engine that keeps a checkpoint there
        (``history_ends``); 0 otherwise (see ``history.history_end``)."""
        if not self.history_ends or self.vision is not None:
            return 0
        return history_end(self.render, self.tokenizer, chat, prepared.text, prepared.tokens)

    # ---- generation --------------------------------------------------------------------

    async def start(self, chat: ChatRequest, request_id: str | None = None) -> Generation:
        """Validate, render and submit; raises InvalidRequest/Overloaded before anything streams.

        Rendering and tokenizing a long prompt, and fetching and decoding a vision prompt's
        media, take a while: they run in a worker thread so the event loop (``/health``,
        other streams) never waits for them. A vision model's processor, which makes MLX
        arrays, runs on the engine thread (``Engine.call``).
        """
        request_id = request_id or f"chatcmpl-{uuid.uuid4().hex[:24]}"
        # Announced to the engine first, so requests that arrive together start together.
        withdraw = self.engine.expect(request_id)
        try:
            req, prepared = await asyncio.to_thread(self.build_request, chat, request_id)
            return self.submit(chat, req, prepared)
        finally:
            withdraw()

    def build_request(
        self, chat: ChatRequest, request_id: str
    ) -> tuple[GenerationRequest, PreparedPrompt]:
        """Everything before the engine: prompt, context check, constraint, cache hints."""
        check_sampling(chat.sampling, self.vocab_size)
        prepared = self.prepare(chat)
        processors = self._constraint_processors(chat, prepared)
        vision_inputs = dict(prepared.vision_inputs) if prepared.vision_inputs else None
        cache_tokens = vision_inputs.pop(CACHE_TOKENS, None) if vision_inputs else None
        req = GenerationRequest(
            request_id=request_id,
            prompt_tokens=prepared.tokens,
            max_tokens=prepared.max_tokens,
            sampling=chat.sampling,
            stop=chat.stop,
            logprobs=chat.logprobs,
            top_logprobs=chat.top_logprobs,
            logits_processors=tuple(processors),
            vision_inputs=vision_inputs,
            cache_tokens=cache_tokens,
            system_prefix_tokens=self.system_prefix_tokens(chat, prepared),
            history_end=self.history_end(chat, prepared),
            ignore_eos=chat.ignore_eos,
            prediction_tokens=self._prediction_tokens(chat),
            # Continuing the final message continues its text: the first token keeps its space.
            continues_text=chat.continue_final_message,
        )
        return req, prepared

    def _prediction_tokens(self, chat: ChatRequest) -> tuple[int, ...]:
        if not chat.prediction:
            return ()
        return tuple(self.tokenizer.encode(chat.prediction, add_special_tokens=False))

    def submit(
        self, chat: ChatRequest, req: GenerationRequest, prepared: PreparedPrompt
    ) -> Generation:
        """Queue a built request on the engine and attach the output parsers."""
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
        return submit(self.engine, req, pipeline)

    def _constraint_processors(
        self, chat: ChatRequest, prepared: PreparedPrompt
    ) -> list[Callable[..., Any]]:
        spec = constraint_spec(chat, self.tool_format if chat.tools else None)
        activate_after = None
        if spec is not None and prepared.start_in_reasoning:
            activate_after = self.tokenizer.encode(self.reasoning_tags[1], add_special_tokens=False)
        return self.grammar_processors(spec, activate_after)

    def grammar_processors(
        self, spec: ConstraintSpec | None, activate_after: list[int] | None = None
    ) -> list[Callable[..., Any]]:
        """A fresh grammar processor for one sequence (none for no ``spec``); InvalidRequest
        where this model cannot enforce it."""
        if spec is None:
            return []
        if self.constraints is None:
            raise InvalidRequest(
                "structured output is not available for this model", param="response_format"
            )
        try:
            return [self.constraints.processor(spec, activate_after=activate_after)]
        except ValueError as e:  # ConstraintError: a grammar llguidance rejects
            raise InvalidRequest(
                f"cannot enforce this request's constraint: {e}", param="response_format"
            ) from e


def _vocab(tokenizer: Any) -> Any:
    try:
        return tokenizer.get_vocab()
    except Exception:  # a tokenizer without a vocabulary to show: trust the template
        return None
