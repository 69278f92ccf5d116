"""The reasoning-detection table of docs/models.md, checked on the real templates: which
markers are found (vocabulary, template text or Harmony channels), whether the rendered
prompt already opens the reasoning block, and how the thinking switch reaches the template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from scripted_engine import ScriptedEngine
from template_corpus import HARMONY_SPECIALS, TEMPLATES, load_tokenizer
from tiny_model import build_tokenizer

from mlx_server.service import ChatService
from mlx_server.types import ChatRequest

BASE = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"]
THINK = ["<think>", "</think>"]

# (template, extra special tokens) -> (markers, opens by default, opens with thinking on,
# opens with thinking off); None: the switch does not apply to this template.
ROWS = {
    ("Qwen-Qwen3-0.6B", "think"): (("<think>", "</think>"), False, False, False),
    ("Qwen-QwQ-32B", "think"): (("<think>", "</think>"), True, True, True),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "think"): (
        ("<think>", "</think>"),
        True,
        True,
        True,
    ),
    ("deepseek-ai-DeepSeek-V3.1", "think"): (("<think>", "</think>"), False, True, False),
    ("GLM-4.6", "think"): (("<think>", "</think>"), False, False, False),
    ("moonshotai-Kimi-K2-Thinking", "think"): (("<think>", "</think>"), False, False, False),
    ("unsloth-MiniMax-M2", "think"): (("<think>", "</think>"), True, True, True),
    ("NVIDIA-Nemotron-Nano-v2", "think"): (("<think>", "</think>"), True, True, False),
    ("ibm-granite-granite-3.3-2B-Instruct", "none"): (("<think>", "</think>"), False, False, False),
    ("ByteDance-Seed-OSS", "seed"): (("<seed:think>", "</seed:think>"), False, False, False),
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use", "r7b"): (
        ("<|START_THINKING|>", "<|END_THINKING|>"),
        False,
        False,
        False,
    ),
    ("Mistral-Small-3.2-24B-Instruct-2506", "magistral"): (
        ("[THINK]", "[/THINK]"),
        False,
        False,
        False,
    ),
    ("openai-gpt-oss-120b", "harmony"): ("harmony", False, False, False),
}
SPECIALS = {
    "think": THINK,
    "none": [],
    "seed": ["<seed:think>", "</seed:think>"],
    "r7b": ["<|START_THINKING|>", "<|END_THINKING|>"],
    "magistral": ["[THINK]", "[/THINK]"],
    "harmony": HARMONY_SPECIALS,
}


def _service(tmp: Path, template: str, specials: str) -> ChatService:
    tmp.mkdir(parents=True, exist_ok=True)
    build_tokenizer(tmp, specials=BASE + SPECIALS[specials])
    config = json.loads((tmp / "tokenizer_config.json").read_text())
    config["chat_template"] = (TEMPLATES / f"{template}.jinja").read_text()
    config["bos_token"] = "<s>"
    (tmp / "tokenizer_config.json").write_text(json.dumps(config))
    return ChatService("m", load_tokenizer(tmp), ScriptedEngine(), ctx_size=8192)


def _opens(service: ChatService, **kwargs) -> bool:
    chat = ChatRequest(messages=[{"role": "user", "content": "Hi"}], template_kwargs=kwargs)
    return service.prepare(chat).start_in_reasoning


@pytest.mark.parametrize("row", list(ROWS), ids=lambda r: r[0])
def test_reasoning_row(row, tmp_path):
    template, specials = row
    markers, default, on, off = ROWS[row]
    service = _service(tmp_path, template, specials)
    found = "harmony" if service.harmony else service.reasoning_tags
    assert found == markers
    assert _opens(service) is default
    assert _opens(service, enable_thinking=True) is on
    assert _opens(service, enable_thinking=False) is off


def test_switch_reaches_templates_under_their_own_names(tmp_path):
    v31 = _service(tmp_path / "v31", "deepseek-ai-DeepSeek-V3.1", "think")
    on = v31.render(ChatRequest(messages=[{"role": "user", "content": "Hi"}],
                                template_kwargs={"enable_thinking": True}))  # fmt: skip
    assert on.endswith("<｜Assistant｜><think>")
    granite = _service(tmp_path / "granite", "ibm-granite-granite-3.3-2B-Instruct", "none")
    text = granite.render(ChatRequest(messages=[{"role": "user", "content": "Hi"}],
                                      template_kwargs={"enable_thinking": True}))  # fmt: skip
    assert "Write your thoughts between <think></think>" in text
    seed = _service(tmp_path / "seed", "ByteDance-Seed-OSS", "seed")
    off = seed.render(ChatRequest(messages=[{"role": "user", "content": "Hi"}],
                                  template_kwargs={"enable_thinking": False}))  # fmt: skip
    default = seed.render(ChatRequest(messages=[{"role": "user", "content": "Hi"}]))
    assert off != default


def test_thinking_off_reaches_nemotron_as_its_marker(tmp_path):
    """Nemotron Nano v2 reads ``/no_think`` in the conversation, not a variable: the switch
    becomes the marker in the system prompt (which the template renders without it)."""
    service = _service(tmp_path, "NVIDIA-Nemotron-Nano-v2", "think")
    hi = {"role": "user", "content": "Hi"}
    off = service.render(ChatRequest(messages=[hi], template_kwargs={"enable_thinking": False}))
    assert off.endswith("<think></think>")
    system = {"role": "system", "content": "Be brief."}
    off = service.render(
        ChatRequest(messages=[system, hi], template_kwargs={"enable_thinking": False})
    )
    assert "Be brief." in off and "/no_think" not in off and off.endswith("<think></think>")
    # The caller's own marker wins.
    think = {"role": "user", "content": "Hi /think"}
    on = service.render(ChatRequest(messages=[think], template_kwargs={"enable_thinking": False}))
    assert on.endswith("<think>\n")
