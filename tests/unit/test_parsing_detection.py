"""Choosing parsers from a real (tiny) tokenizer loaded through mlx-lm."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import TokenizerWrapper, load
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from mlx_server.parsing.pipeline import OutputPipeline, collect
from mlx_server.parsing.reasoning import prompt_opens_reasoning, reasoning_tags
from mlx_server.parsing.tool_formats import detect_tool_parser, resolve_tool_parser

QWEN3_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}"
    "{{ tool | tojson }}{% endfor %}</tools>\nFor each function call, return a json object "
    'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n{%- endif %}'
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '\n<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments }}}'
    "\n</tool_call>{%- endfor %}{%- endif %}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- else %}<think>\n{%- endif %}{%- endif %}"
)
QWEN3_CODER_TEMPLATE = (
    "{%- for message in messages %}{{ message.content }}{%- endfor %}"
    "<tool_call>\n<function={{ name }}>\n<parameter=x>\n</parameter>\n</function>\n</tool_call>"
)
HERMES_TEMPLATE = (
    "{%- for message in messages %}{{ message.content }}{%- endfor %}"
    "<tool_call>{{ call['name'] }}</tool_call>"
)
LLAMA3_TEMPLATE = (
    "{%- for m in messages %}{{ m.content }}{%- endfor %}"
    "{%- if builtin_tools %}<|python_tag|>{%- endif %}"
)
MISTRAL_TEMPLATE = (
    "{%- for message in messages %}[INST]{{ message.content }}[/INST]{%- endfor %}[TOOL_CALLS]"
)
MINIMAX_TEMPLATE = "{%- for m in messages %}{{ m.content }}{%- endfor %}<minimax:tool_call>"
PLAIN_TEMPLATE = "{%- for message in messages %}{{ message.content }}{%- endfor %}"

WORDS = ["<unk>", "<|im_start|>", "<|im_end|>", "hello", "user", "assistant"]
THINK = ["<think>", "</think>"]


def make_tokenizer(
    directory: Path, template: str, extra_words=(), config: dict | None = None
) -> TokenizerWrapper:
    words = [*WORDS, *extra_words]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>", chat_template=template
    )
    hf.save_pretrained(directory)
    if config:
        path = directory / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return load(directory)


@pytest.fixture
def qwen3(tmp_path) -> TokenizerWrapper:
    return make_tokenizer(tmp_path, QWEN3_TEMPLATE, THINK)


def test_qwen3_template_is_detected_as_json_tools(qwen3):
    fmt = resolve_tool_parser(None, qwen3)
    assert fmt is not None
    assert (fmt.name, fmt.start, fmt.end) == ("json_tools", "<tool_call>", "</tool_call>")
    assert resolve_tool_parser("auto", qwen3) == fmt
    # The same answer from the bare Hugging Face tokenizer.
    assert detect_tool_parser(qwen3._tokenizer) == "json_tools"


@pytest.mark.parametrize(
    "template, expected",
    [
        (QWEN3_CODER_TEMPLATE, "qwen3_coder"),
        (MISTRAL_TEMPLATE, "mistral"),
        (MINIMAX_TEMPLATE, "minimax_m2"),
        (HERMES_TEMPLATE, "json_tools"),  # only "<tool_call>": taken as Hermes JSON
        (LLAMA3_TEMPLATE, "llama3_json"),
        (PLAIN_TEMPLATE, None),
    ],
)
def test_detection_from_template(tmp_path, template, expected):
    fmt = resolve_tool_parser(None, make_tokenizer(tmp_path, template))
    assert (fmt.name if fmt else None) == expected


def test_tokenizer_config_choice_wins(tmp_path):
    tokenizer = make_tokenizer(tmp_path, QWEN3_TEMPLATE, config={"tool_parser_type": "glm47"})
    assert resolve_tool_parser(None, tokenizer).name == "glm47"


def test_vocabulary_fallback_for_pythonic(tmp_path):
    words = ["<|tool_call_start|>", "<|tool_call_end|>"]
    tokenizer = make_tokenizer(tmp_path, PLAIN_TEMPLATE, words)
    assert resolve_tool_parser(None, tokenizer).name == "pythonic"


def test_override_beats_detection_and_unknown_names_fail(qwen3):
    assert resolve_tool_parser("mistral", qwen3).name == "mistral"
    assert resolve_tool_parser("none", qwen3) is None
    with pytest.raises(ValueError, match="valid names: .*json_tools.*qwen3_coder"):
        resolve_tool_parser("hermes", qwen3)


def test_reasoning_tags_from_the_vocabulary(qwen3, tmp_path):
    assert reasoning_tags(qwen3) == ("<think>", "</think>")
    assert reasoning_tags(qwen3._tokenizer) == ("<think>", "</think>")
    plain = make_tokenizer(tmp_path / "plain", PLAIN_TEMPLATE)
    assert reasoning_tags(plain) is None
    assert reasoning_tags(None) is None
    magistral = make_tokenizer(tmp_path / "magistral", PLAIN_TEMPLATE, ["[THINK]", "[/THINK]"])
    assert reasoning_tags(magistral) == ("[THINK]", "[/THINK]")


def test_rendered_prompt_decides_start_in_reasoning(qwen3):
    messages = [{"role": "user", "content": "hello"}]
    thinking = qwen3.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt_opens_reasoning(thinking, "<think>", "</think>")
    off = qwen3.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert not prompt_opens_reasoning(off, "<think>", "</think>")


def test_end_to_end_with_detected_parsers(qwen3):
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    messages = [{"role": "user", "content": "hello"}]
    prompt = qwen3.apply_chat_template(
        messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    tags = reasoning_tags(qwen3)
    pipeline = OutputPipeline(
        reasoning=tags,
        start_in_reasoning=prompt_opens_reasoning(prompt, *tags),
        tool_format=resolve_tool_parser(None, qwen3),
        tools=tools,
    )
    output = 'I should call it.\n</think>\n\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    message = collect([e for ch in output for e in pipeline.feed(ch)] + pipeline.flush())
    assert message["reasoning_content"] == "I should call it."
    assert message["content"] is None
    assert [(c["name"], c["arguments"]) for c in message["tool_calls"]] == [("get_time", "{}")]


def test_every_format_is_registered_the_same_way():
    """One registry (parsing/formats): each module is a tool-call format or a message
    format, and declares its own markers unless mlx-lm detects it."""
    from mlx_server.parsing.formats import registered
    from mlx_server.parsing.tool_formats import available_tool_parsers

    by_name = {r.name: r for r in registered()}
    assert by_name["harmony"].writes_messages and by_name["functionary_v3_2"].writes_messages
    assert "llama3_json" in by_name and not by_name["llama3_json"].writes_messages
    for r in registered():
        if r.writes_messages:
            assert r.module.template_markers and r.name not in available_tool_parsers()
        else:
            assert callable(r.module.parse_tool_call) and r.name in available_tool_parsers()
            assert r.module.template_markers or r.name == "mistral"  # mlx-lm detects mistral


@pytest.mark.parametrize(
    ("template", "vocab", "expected"),
    [
        ("<|start|>{{ m }}<|channel|>final<|message|>", {"<|channel|>": 1}, (None, "harmony")),
        ("<|channel|>x<|message|>", {"a": 1}, ("json_tools", None)),  # no channel token
        ('>>>all {{ ">>>" + tool_call }}', None, (None, "functionary_v3_2")),
        (QWEN3_TEMPLATE, None, ("json_tools", None)),
    ],
)
def test_one_value_for_the_output_format(qwen3, template, vocab, expected):
    from mlx_server.parsing.detection import detect_output_format

    found = detect_output_format(qwen3, template, vocab)
    assert (found.tools.name if found.tools else None, found.messages) == expected
    # An explicit parser stays beside a message format.
    explicit = detect_output_format(qwen3, template, vocab, "mistral")
    assert explicit.tools is not None and explicit.tools.name == "mistral"
    assert explicit.messages == expected[1]


class _WrapperWithoutThinking:
    """A tokenizer shaped like mlx-lm's wrapper that found no thinking tags, counting how
    often its vocabulary is built."""

    think_start = property(lambda self: None)
    think_end = property(lambda self: None)

    def __init__(self, vocab):
        self.vocab, self.built = vocab, 0

    def get_vocab(self):
        self.built += 1
        return dict(self.vocab)


def test_reasoning_tags_use_a_vocabulary_already_built():
    tokenizer = _WrapperWithoutThinking({"[THINK]": 1, "[/THINK]": 2})
    assert reasoning_tags(tokenizer, "", tokenizer.get_vocab()) == ("[THINK]", "[/THINK]")
    assert tokenizer.built == 1  # the one the caller built
    assert reasoning_tags(tokenizer) == ("[THINK]", "[/THINK]")  # without one: its own
    assert tokenizer.built == 2
