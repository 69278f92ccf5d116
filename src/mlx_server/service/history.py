"""Where a chat prompt's conversation history ends and its generation prompt begins: the
point an engine whose cache cannot be rewound keeps a checkpoint at, for the next turn.

The next turn's prompt repeats this turn's history. Most templates' generation prompt
(ChatML's ``<|im_start|>assistant\n``) is repeated too, as the start of the answer's turn:
then the checkpoint at the prompt's end serves, and no other is needed. Some end it with
something the next turn does not repeat (Nemotron-H's ``<think>\n``, Qwen3's empty
reasoning block without thinking): then the history's end is where the next turn resumes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from mlx_server.errors import InvalidRequest
from mlx_server.models.prompt import history_tokens
from mlx_server.types import ChatRequest

# A next turn to render: an answer, then a user message (placeholders).
_NEXT_TURN = [{"role": "assistant", "content": "x"}, {"role": "user", "content": "x"}]


def history_end(
    render: Callable[[ChatRequest], str],
    tokenizer: Any,
    chat: ChatRequest,
    text: str,
    tokens: list[int],
) -> int:
    """How many leading ``tokens`` (the prompt ``text`` that ``render`` made of ``chat``)
    render the conversation without the generation prompt, when a next turn repeats those
    but not the generation prompt; 0 when the next turn repeats the whole prompt, for a
    prompt without a generation prompt, or where no boundary is found. The template runs
    twice more (a next turn; no generation prompt)."""
    if not chat.add_generation_prompt or chat.continue_final_message:
        return 0
    try:
        if render(replace(chat, messages=[*chat.messages, *_NEXT_TURN])).startswith(text):
            return 0
        history = render(replace(chat, add_generation_prompt=False))
    except InvalidRequest:  # a template that refuses either: no boundary
        return 0
    return history_tokens(tokenizer, tokens, text, history)
