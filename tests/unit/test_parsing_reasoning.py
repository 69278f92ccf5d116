"""Reasoning split: explicit and implicit blocks, tags split anywhere, whitespace, parity."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_server.events import ReasoningDelta, TextDelta
from mlx_server.parsing.pipeline import merge_events
from mlx_server.parsing.reasoning import ReasoningSplitter, prompt_opens_reasoning

R, T = ReasoningDelta, TextDelta


def run(pieces, **kw) -> list:
    splitter = ReasoningSplitter(**kw)
    events = []
    for piece in pieces:
        events += splitter.feed(piece)
    return merge_events(events + splitter.flush())


CASES = [
    # (name, output, start_in_reasoning, expected events)
    (
        "explicit",
        "<think>Let me think.</think>Answer is 4.",
        False,
        [R("Let me think."), T("Answer is 4.")],
    ),
    ("no tags", "Just an answer.", False, [T("Just an answer.")]),
    ("text before opener", "Hmm. <think>a</think>b", False, [T("Hmm."), R("a"), T("b")]),
    ("implicit", "Let me think.\n</think>\n\nAnswer.", True, [R("Let me think."), T("Answer.")]),
    (
        "implicit, opener repeated",
        "<think>\nLet me think.\n</think>\n\nAnswer.",
        True,
        [R("Let me think."), T("Answer.")],
    ),
    ("implicit, no reasoning", "</think>Answer.", True, [T("Answer.")]),
    (
        "qwen3 layout",
        "<think>\nStep 1.\n\nStep 2.\n</think>\n\nDone.",
        False,
        [R("Step 1.\n\nStep 2."), T("Done.")],
    ),
    ("empty block", "<think>\n\n</think>\n\nHello", False, [T("Hello")]),
    ("two blocks", "<think>a</think>b\n<think>c</think>d", False, [R("a"), T("b"), R("c"), T("d")]),
    ("unterminated", "<think>still thinking", False, [R("still thinking")]),
    ("partial opener at end", "answer <thi", False, [T("answer <thi")]),
    ("partial closer at end", "<think>x </thi", False, [R("x </thi")]),
    ("whitespace only", " \n ", False, [T(" \n ")]),
    ("blank before opener", "\n\n<think>a</think>b", False, [R("a"), T("b")]),
    ("closer in content", "a</think>b", False, [T("a</think>b")]),
    ("inner whitespace kept", "  a\n\nb  ", False, [T("  a\n\nb  ")]),
    ("opener later in reasoning", "x <think> y</think>z", True, [R("x <think> y"), T("z")]),
]


@pytest.mark.parametrize("name, text, implicit, expected", CASES, ids=[c[0] for c in CASES])
def test_cases_whole_char_and_every_split(name, text, implicit, expected):
    assert run([text], start_in_reasoning=implicit) == expected
    assert run(list(text), start_in_reasoning=implicit) == expected
    for i in range(len(text) + 1):
        assert run([text[:i], text[i:]], start_in_reasoning=implicit) == expected, i


def test_jan_worked_example_tokens():
    tokens = ["<think>", "Let me think", "</think>", "Answer is 4."]
    assert run(tokens) == [R("Let me think"), T("Answer is 4.")]


def test_nothing_tag_like_is_emitted_early():
    splitter = ReasoningSplitter()
    assert splitter.feed("Hello <") == [T("Hello")]
    assert splitter.feed("thin") == []
    assert splitter.feed("k>deep") == [R("deep")]
    assert splitter.in_reasoning
    assert splitter.feed("</") == []
    assert splitter.feed("think>\nOK") == [T("OK")]
    assert not splitter.in_reasoning


def test_unterminated_reasoning_stays_reasoning():
    splitter = ReasoningSplitter(start_in_reasoning=True)
    events = splitter.feed("I am still") + splitter.feed(" thinking") + splitter.flush()
    assert merge_events(events) == [R("I am still thinking")]
    assert splitter.in_reasoning


def test_custom_tags():
    text = "<|channel>thought plan<channel|>answer"
    events = run([text], start_tag="<|channel>thought", end_tag="<channel|>")
    assert events == [R("plan"), T("answer")]


def test_verbatim_span_keeps_tags_inside_tool_markup():
    text = '<tool_call>{"a": "<think>"}</tool_call><think>r</think>'
    events = run(list(text), verbatim=[("<tool_call>", "</tool_call>")])
    assert events == [T('<tool_call>{"a": "<think>"}</tool_call>'), R("r")]
    open_ended = run(['[TOOL_CALLS]f[ARGS]{"<think>": 1}'], verbatim=[("[TOOL_CALLS]", "")])
    assert open_ended == [T('[TOOL_CALLS]f[ARGS]{"<think>": 1}')]


def test_flush_twice_is_harmless():
    splitter = ReasoningSplitter()
    splitter.feed("a <")
    assert splitter.flush() == [T(" <")]
    assert splitter.flush() == []


def test_empty_tags_are_rejected():
    with pytest.raises(ValueError):
        ReasoningSplitter("", "</think>")


# -- property: any text, any split


TEXT = st.lists(
    st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "a", "b c", " ", "\n", "é"]),
    max_size=25,
).map("".join)


@settings(max_examples=150, deadline=None)
@given(TEXT, st.booleans(), st.data())
def test_random_splits_give_same_events(text, implicit, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    pieces = [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]
    assert run(pieces, start_in_reasoning=implicit) == run([text], start_in_reasoning=implicit)


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet="ab <>/\n.thinké", max_size=40), st.data())
def test_text_without_tags_is_returned_exactly(text, data):
    if "<think>" in text or "</think>" in text:
        return
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]
    events = run(pieces)
    assert "".join(e.text for e in events) == text
    assert all(isinstance(e, TextDelta) for e in events)


def reference_split(text: str) -> tuple[str, str]:
    """A plain, non-incremental split: (content, reasoning) with all whitespace removed."""
    content, reasoning, in_block = [], [], False
    while text:
        if not in_block:
            pos = text.find("<think>")
            content.append(text if pos < 0 else text[:pos])
            text = "" if pos < 0 else text[pos + len("<think>") :]
            in_block = pos >= 0
            if in_block and text.lstrip().startswith("<think>"):
                text = text.lstrip()[len("<think>") :]
        else:
            pos = text.find("</think>")
            reasoning.append(text if pos < 0 else text[:pos])
            text = "" if pos < 0 else text[pos + len("</think>") :]
            in_block = pos < 0
    squash = lambda parts: "".join("".join(parts).split())  # noqa: E731
    return squash(content), squash(reasoning)


@settings(max_examples=150, deadline=None)
@given(TEXT)
def test_nothing_but_tags_and_blank_space_is_removed(text):
    events = run(list(text))
    content = "".join("".join(e.text for e in events if isinstance(e, T)).split())
    reasoning = "".join("".join(e.text for e in events if isinstance(e, R)).split())
    assert (content, reasoning) == reference_split(text)


# -- prompt detection


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("<|im_start|>assistant\n<think>\n", True),
        ("<｜Assistant｜><think>", True),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # Qwen3, thinking off
        ("<|im_start|>assistant\n", False),
        ("<think>old</think> user: hi\n<|im_start|>assistant\n<think>  \n", True),
        ("<|im_start|>assistant\n<think>\nI already started", False),
    ],
)
def test_prompt_opens_reasoning(prompt, expected):
    assert prompt_opens_reasoning(prompt, "<think>", "</think>") is expected
