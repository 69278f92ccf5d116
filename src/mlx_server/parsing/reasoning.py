"""Split generated text into reasoning and answer at the model's think tags.

``ReasoningSplitter`` is an incremental decoder: ``feed(text)`` returns the events that are
certain so far, ``flush()`` the rest at the end of generation. It holds back only a tail
that could still grow into a tag, and whitespace at the ends of a segment (see below); it
drops nothing but tags and the whitespace next to them.

Behaviour:

- Every ``start_tag ... end_tag`` block is reasoning, not only the first one (models with
  interleaved thinking open several blocks in one answer); text outside blocks is content,
  including text before the first opener.
- ``start_in_reasoning=True`` is for prompts that already opened the block (the template
  ended with ``<think>``): output is reasoning until ``end_tag``. If the model emits the
  opener anyway as its first non-blank text, the opener is dropped, not shown as reasoning.
- Whitespace next to a tag is dropped: leading whitespace of a segment that follows a tag
  (``</think>\\n\\nAnswer`` gives content ``Answer``) and trailing whitespace before a tag
  (reasoning ``...done.\\n</think>`` ends with ``done.``). To know, a segment's trailing
  whitespace is held until more text arrives. Whitespace inside text, and at the very start
  or end of the output, is kept.
- ``verbatim`` spans (tool-call markup) are copied to content untouched: a ``<think>``
  written inside a tool call's arguments stays part of the arguments.
- An unterminated block stays reasoning at ``flush()``; ``in_reasoning`` is then True.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mlx_server.events import ReasoningDelta, TextDelta
from mlx_server.parsing.tags import SteppedDecoder, find_first, held_tail_len, hold_trailing_space

_CONTENT = "content"
_REASONING = "reasoning"
_VERBATIM = "verbatim"

SplitEvent = TextDelta | ReasoningDelta


class ReasoningSplitter(SteppedDecoder[SplitEvent]):
    """Incremental splitter of generated text into ``ReasoningDelta`` and ``TextDelta``."""

    def __init__(
        self,
        start_tag: str = "<think>",
        end_tag: str = "</think>",
        *,
        start_in_reasoning: bool = False,
        verbatim: Sequence[tuple[str, str]] = (),
    ) -> None:
        """``verbatim``: ``(open, close)`` pairs of content spans where think tags are not
        interpreted; an empty ``close`` means the span runs to the end of the output."""
        if not start_tag or not end_tag:
            raise ValueError("reasoning tags must be non-empty strings")
        self._start = start_tag
        self._end = end_tag
        self._verbatim = {open_: close for open_, close in verbatim if open_}
        self._opens = [start_tag, *self._verbatim]  # what content text may open
        self._mode = _REASONING if start_in_reasoning else _CONTENT
        self._verbatim_close = ""
        super().__init__()
        # Segment bookkeeping: a segment is the text between two tags.
        self._fresh = True  # nothing emitted in this segment yet
        self._drop_lead = start_in_reasoning  # drop the segment's leading whitespace
        self._held_ws = ""  # whitespace held while it may precede a tag
        self._block_start = start_in_reasoning  # a stray opener may still come

    @property
    def in_reasoning(self) -> bool:
        """True while inside a reasoning block (after ``flush``: it was never closed)."""
        return self._mode == _REASONING

    def flush(self) -> list[SplitEvent]:
        """End of generation: emit whatever was held back."""
        out: list[SplitEvent] = []
        kind = ReasoningDelta if self._mode == _REASONING else TextDelta
        buf, self._buf = self._buf, ""
        self._emit(out, kind, buf)
        if self._held_ws:  # no tag after it: it is part of the text
            out.append(kind(self._held_ws))
            self._held_ws = ""
        return out

    # -- one step per tag; returns True when a tag was consumed and another step may follow

    def _step(self, out: list[SplitEvent]) -> bool:
        if self._mode == _CONTENT:
            return self._step_content(out)
        if self._mode == _REASONING:
            return self._step_reasoning(out)
        return self._step_verbatim(out)

    def _step_content(self, out: list[SplitEvent]) -> bool:
        opens = self._opens
        hit = find_first(self._buf, opens)
        if hit is None:
            self._emit_safe(out, TextDelta, opens)
            return False
        pos, tag = hit
        if tag == self._start:
            self._emit(out, TextDelta, self._buf[:pos])
            self._buf = self._buf[pos + len(tag) :]
            self._enter(_REASONING)
            self._block_start = True
            return True
        # Tool markup: the open tag itself is content for the tool-call parser.
        self._emit(out, TextDelta, self._buf[: pos + len(tag)])
        self._buf = self._buf[pos + len(tag) :]
        self._mode = _VERBATIM
        self._verbatim_close = self._verbatim[tag]
        return True

    def _step_reasoning(self, out: list[SplitEvent]) -> bool:
        if self._block_start and not self._skip_stray_opener():
            return False
        pos = self._buf.find(self._end)
        if pos < 0:
            self._emit_safe(out, ReasoningDelta, [self._end])
            return False
        self._emit(out, ReasoningDelta, self._buf[:pos])
        self._buf = self._buf[pos + len(self._end) :]
        self._enter(_CONTENT)
        return True

    def _step_verbatim(self, out: list[SplitEvent]) -> bool:
        close = self._verbatim_close
        pos = self._buf.find(close) if close else -1
        if pos < 0:
            if close:
                self._emit_safe(out, TextDelta, [close])
            else:
                self._emit(out, TextDelta, self._buf)
                self._buf = ""
            return False
        self._emit(out, TextDelta, self._buf[: pos + len(close)])
        self._buf = self._buf[pos + len(close) :]
        self._mode = _CONTENT
        return True

    def _skip_stray_opener(self) -> bool:
        """At a block's start, drop an opener the model repeated; False while undecided."""
        rest = self._buf.lstrip()
        if rest.startswith(self._start):
            self._buf = rest[len(self._start) :]
        elif not rest or self._start.startswith(rest):
            return False
        self._block_start = False
        return True

    # -- emission

    def _enter(self, mode: str) -> None:
        self._mode = mode
        self._fresh = True
        self._drop_lead = True
        self._held_ws = ""  # whitespace-only text right before a tag is dropped

    def _emit_safe(self, out: list[SplitEvent], kind: type[SplitEvent], tags: list[str]) -> None:
        keep = held_tail_len(self._buf, tags)
        cut = len(self._buf) - keep
        self._emit(out, kind, self._buf[:cut])
        self._buf = self._buf[cut:]

    def _emit(self, out: list[SplitEvent], kind: type[SplitEvent], text: str) -> None:
        # Whitespace at either end of a segment is held: it is dropped if a tag follows.
        lead = self._fresh and self._drop_lead
        body, self._held_ws = hold_trailing_space(text, self._held_ws, drop_leading=lead)
        if body:
            self._fresh = False
            out.append(kind(body))


def prompt_opens_reasoning(prompt_text: str, start_tag: str, end_tag: str) -> bool:
    """True when the rendered prompt ends inside an open reasoning block.

    That is: the last ``start_tag`` comes after the last ``end_tag`` and only whitespace
    follows it. Qwen3 with ``enable_thinking=False`` renders ``<think>\\n\\n</think>\\n\\n``,
    which is closed, so it gives False.
    """
    if not start_tag:
        return False
    pos = prompt_text.rfind(start_tag)
    if pos < 0:
        return False
    if end_tag and prompt_text.rfind(end_tag) > pos:
        return False
    return not prompt_text[pos + len(start_tag) :].strip()


# Think tags mlx-lm does not infer (it knows <think>, <longcat_think>, <|think:start|>,
# Gemma's channel and the XTML markers); looked up in the vocabulary as single tokens, then
# in the chat template's text.
_EXTRA_THINK_TAGS = (
    ("[THINK]", "[/THINK]"),  # Magistral
    ("<seed:think>", "</seed:think>"),  # ByteDance Seed-OSS
    ("<|START_THINKING|>", "<|END_THINKING|>"),  # Cohere Command R7B / A
)
# Tags written as plain text (not special tokens), found in the template: Granite 3.3
# asks for <think></think> in its system prompt.
_TEMPLATE_THINK_TAGS = (*_EXTRA_THINK_TAGS, ("<think>", "</think>"))


def reasoning_tags(
    tokenizer: object, template: str = "", vocab: Mapping[str, int] | None = None
) -> tuple[str, str] | None:
    """The model's ``(think_start, think_end)`` strings, or None when it has none.

    Reads them from an mlx-lm ``TokenizerWrapper`` (which infers them from the vocabulary);
    for a bare Hugging Face tokenizer, runs the same inference on its vocabulary. Also knows
    Magistral's ``[THINK]``, Seed-OSS's ``<seed:think>`` and Command R7B's
    ``<|START_THINKING|>`` (in the vocabulary, else in the chat ``template``'s text).
    ``vocab``: the tokenizer's vocabulary when the caller has it already (building it takes
    a tenth of a second on a large one).
    """
    if tokenizer is None:
        return None
    start = end = None
    if getattr(type(tokenizer), "think_start", None) is not None:  # a TokenizerWrapper
        start, end = tokenizer.think_start, tokenizer.think_end  # type: ignore[attr-defined]
    elif hasattr(tokenizer, "get_vocab"):
        from mlx_lm.tokenizer_utils import _infer_thinking

        try:
            start, end = _infer_thinking(tokenizer)[:2]
        except Exception:  # an unusual tokenizer: fall through to the vocabulary check
            pass
    if isinstance(start, str) and isinstance(end, str) and start and end:
        return start, end
    return _extra_tags(tokenizer, vocab) or next(
        ((a, b) for a, b in _TEMPLATE_THINK_TAGS if a in template and b in template), None
    )


def _extra_tags(tokenizer: object, vocab: Mapping[str, int] | None) -> tuple[str, str] | None:
    if vocab is None:
        try:
            vocab = tokenizer.get_vocab()  # type: ignore[attr-defined]
        except Exception:
            return None
    for start, end in _EXTRA_THINK_TAGS:
        if start in vocab and end in vocab:
            return start, end
    return None
