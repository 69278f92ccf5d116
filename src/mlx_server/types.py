"""Neutral request values: what every protocol adapter produces for the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, cast


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    # OpenAI's logit_bias: (token id, bias) pairs added to the model's logits before
    # sampling, sorted by id (a tuple, so the settings stay hashable).
    logit_bias: tuple[tuple[int, float], ...] = ()


# "auto": the model decides; "none": tools are not shown and nothing is parsed;
# "required": exactly one call to any tool; "function": one call to a named tool.
ToolChoiceMode = Literal["auto", "none", "required", "function"]
# "auto": split reasoning out of the answer; "none": raw text, reasoning and all.
ReasoningFormat = Literal["auto", "none"]


@dataclass(frozen=True)
class ToolChoice:
    """Whether and how the answer must call a tool, whatever the protocol called it.

    ``mode``: "auto" (the model decides), "none" (tools are not shown and nothing is
    parsed), "required" (exactly one call to any tool), "function" (one call to ``name``)."""

    mode: ToolChoiceMode = "auto"
    name: str | None = None

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "function")

    @staticmethod
    def of(mode: str) -> ToolChoice:
        """A tool choice named by a protocol's string ("auto", "none", "required"), which
        its schema has already checked."""
        if mode not in ("auto", "none", "required"):
            raise ValueError(f"not a tool_choice mode: {mode!r}")
        return ToolChoice(cast(ToolChoiceMode, mode))


AUTO = ToolChoice()
NO_TOOLS = ToolChoice("none")


@dataclass(frozen=True)
class ChatRequest:
    """A chat conversation to render and generate from, independent of the protocol.

    ``messages`` use the Hugging Face chat-template shape (role, content, tool_calls with
    ``function.arguments`` as a dict, tool_call_id, reasoning_content), because that is
    what chat templates consume.
    """

    messages: list[dict[str, Any]]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice = AUTO
    parallel_tool_calls: bool = True
    logprobs: bool = False
    top_logprobs: int = 0
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning_format: ReasoningFormat = "auto"
    # Never end at the end-of-sequence token (llama.cpp's ignore_eos; for benchmarks).
    ignore_eos: bool = False
    # Structured output, protocol-neutral: None (free text), {"type": "json_object"} or
    # {"type": "json_schema", "schema": {...}}. Enforced with a grammar, like a
    # tool_choice of "required" or a named function.
    response_format: dict[str, Any] | None = None
    # The chat-template controls vLLM defines: end the prompt with the assistant's turn
    # opened (the default), or leave the final (assistant) message open and continue it.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # OpenAI's Predicted Outputs: text the answer is expected to repeat, or None.
    prediction: str | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """What the engine runs: token ids in, text pieces out."""

    request_id: str
    prompt_tokens: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    # Extra mlx-lm logits processors (e.g. a grammar constraint), built per request.
    logits_processors: tuple[Any, ...] = ()
    # A vision model's inputs besides the token ids (the processor's pixel_values,
    # attention_mask, image_grid_thw, ...), or None for a text-only prompt.
    vision_inputs: dict[str, Any] | None = None
    ignore_eos: bool = False
    # Leading prompt tokens that render the system prompt (and tools): the engine keeps the
    # KV state of that prefix in its prefix cache longest. 0 when unknown.
    system_prefix_tokens: int = 0
    # Where the conversation's history ends, before the generation prompt (0: not known):
    # an engine whose cache cannot be rewound keeps the state there for the next turn.
    history_end: int = 0
    # OpenAI's Predicted Outputs: the tokens of the text the client expects, drafted for
    # speculative decoding (empty: none given).
    prediction_tokens: tuple[int, ...] = ()
    # Raw text completion or a continued final message: the output continues the prompt's
    # text, so its first token keeps a leading space (a chat answer starts a text of its
    # own, and drops it).
    continues_text: bool = False
    # A prompt with media: its tokens as the prefix cache keys them, each media placeholder
    # carrying the media's digest (models/media_key.py); None: the tokens themselves.
    cache_tokens: list[int] | None = None

    @property
    def cache_key(self) -> list[int]:
        """The prompt as the prefix cache keys it."""
        return self.cache_tokens if self.cache_tokens is not None else self.prompt_tokens
