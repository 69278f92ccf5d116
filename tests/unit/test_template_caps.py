"""What each vendored template needs from the caller, as probed at load, and the named
templates (default / tool_use) a tokenizer may carry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from scripted_engine import ScriptedEngine
from template_corpus import TEMPLATES, load_tokenizer, template_files

from mlx_server.models.chat_template import ChatTemplate
from mlx_server.models.loader import read_chat_template
from mlx_server.service import ChatService
from mlx_server.types import ChatRequest

# Template -> the caps it needs; every other template needs none.
EXPECTED = {
    "Apertus-8B-Instruct": {"string_arguments", "flat_tools", "tool_descriptions"},
    "CohereForAI-c4ai-command-r-plus-tool_use": {"tool_results_as_user", "tool_descriptions"},
    "Mistral-Small-3.2-24B-Instruct-2506": {"short_call_ids"},
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": {"tool_descriptions"},
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": {"tool_descriptions"},
    # DeepSeek R1 renders a call only when the turn's content is None, and concatenates
    # the arguments string.
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": {"string_arguments", "null_content_with_calls"},
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": {"string_arguments", "null_content_with_calls"},
    "deepseek-ai-DeepSeek-V3.1": {"string_arguments"},
    "fireworks-ai-llama-3-firefunction-v2": {"string_arguments"},
    "google-gemma-2-2b-it": {"merge_system", "tool_results_as_user"},
    "llama-cpp-rwkv-world": {"tool_results_as_user"},
    "meetkai-functionary-medium-v3.1": {"string_arguments", "tool_descriptions"},
    "meetkai-functionary-medium-v3.2": {"string_arguments"},
    "microsoft-Phi-3.5-mini-instruct": {"tool_results_as_user"},
    "mistralai-Mistral-Nemo-Instruct-2407": {"short_call_ids"},
    "openai-gpt-oss-120b": {"text_into_reasoning", "tool_descriptions"},
}


@pytest.mark.parametrize("path", template_files(), ids=lambda p: p.stem)
def test_probed_caps(path: Path):
    template = ChatTemplate(
        {"default": path.read_text()}, {"bos_token": "<s>", "eos_token": "</s>"}
    )
    found = {name for name, on in vars(template.caps).items() if on}
    assert found == EXPECTED.get(path.stem, set())


CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
}
TURNS = [
    {"role": "user", "content": "Weather?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
]


def test_string_arguments_are_concatenated():
    """functionary v3.2 writes '...' + arguments: the object would fail to render."""
    source = (TEMPLATES / "meetkai-functionary-medium-v3.2.jinja").read_text()
    text = ChatTemplate({"default": source}, {"bos_token": "<s>"}).render(TURNS)
    assert '{"city": "Paris"}' in text


def test_deepseek_r1_keeps_the_call_of_a_turn_without_text():
    source = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    text = ChatTemplate({"default": source}, {"bos_token": "<s>"}).render(TURNS)
    assert "<｜tool▁calls▁begin｜>" in text and '{"city": "Paris"}' in text


HERMES_TOOL_USE = (TEMPLATES / "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja").read_text()
PLAIN = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_named_templates_pick_tool_use_when_tools_are_offered(tmp_path: Path):
    from tiny_model import build_tokenizer

    build_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": PLAIN},
        {"name": "tool_use", "template": HERMES_TOOL_USE},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    named = read_chat_template(tmp_path)
    assert isinstance(named, dict) and set(named) == {"default", "tool_use"}
    tokenizer = load_tokenizer(tmp_path)
    tokenizer._tokenizer.chat_template = named
    service = ChatService("m", tokenizer, ScriptedEngine(), ctx_size=4096)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    with_tools = service.render(ChatRequest(messages=TURNS[:1], tools=tools))
    assert "<tools>" in with_tools and "get_weather" in with_tools
    without = service.render(ChatRequest(messages=TURNS[:1]))
    assert "<tools>" not in without and without.endswith("<|im_start|>assistant\n")


def test_caller_variables_are_given_as_the_reference_code_gives_them():
    from datetime import datetime

    from mlx_server.models.chat_template import TemplateError

    user = [{"role": "user", "content": "Hi"}]
    llama = ChatTemplate(
        {"default": (TEMPLATES / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text()},
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    ).render(user)
    assert llama.startswith("<|begin_of_text|>")
    assert f"Today Date: {datetime.now().strftime('%d %b %Y')}" in llama
    gpt_oss = ChatTemplate(
        {"default": (TEMPLATES / "openai-gpt-oss-120b.jinja").read_text()}, {}
    ).render(user, template_kwargs={"reasoning_effort": "low"})
    assert f"Current date: {datetime.now().strftime('%Y-%m-%d')}" in gpt_oss
    assert "Reasoning: low" in gpt_oss
    gemma = ChatTemplate({"default": (TEMPLATES / "google-gemma-2-2b-it.jinja").read_text()}, {})
    with pytest.raises(TemplateError, match="roles must alternate"):
        two = [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]
        gemma.render([*user, *two])


def test_firefunction_s_system_prompt_is_the_same_all_day():
    """Its ``datetime`` is the day (UTC midnight, in the reference's format): a prompt that
    changed every second would never be served from the prefix cache."""
    from datetime import datetime, timezone

    from mlx_server.models.chat_template import _caller_variables

    got = _caller_variables("{{ datetime }}", None)["datetime"]
    assert got == datetime.now(timezone.utc).strftime("%b %d %Y") + " 00:00:00 GMT"
