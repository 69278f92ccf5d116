"""System messages after the first turn: rendered in place where the chat template can,
folded into the leading system message where it cannot (raises, drops or moves them)."""

from __future__ import annotations

from pathlib import Path

import anthropic
import httpx
import pytest
from support import start_in_process
from tiny_model import build_tokenizer

from mlx_server.models.chat_template import ChatTemplate, load_chat_template
from mlx_server.models.system_turns import (
    fold_late_system_messages,
    has_late_system,
    renders_system_in_place,
)

_TURNS = (
    "{% for message in loop_messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_LEADING = (
    "{% if messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{% set rest = messages[1:] %}{% else %}{% set rest = messages %}{% endif %}"
)
# Like Mistral's and Gemma's templates: a system message anywhere but first is an error.
REJECTING = (
    _LEADING
    + "{% for m in rest %}{% if m['role'] == 'system' %}"
    + "{{ raise_exception('System message must be at the beginning.') }}{% endif %}{% endfor %}"
    + "{% set loop_messages = rest %}"
    + _TURNS
)
# Renders the first system message and user/assistant turns; later system messages vanish.
DROPPING = (
    _LEADING
    + "{% set loop_messages = rest | selectattr('role', 'in', ['user', 'assistant']) | list %}"
    + _TURNS
)
# Gathers every system message at the top.
HOISTING = (
    "{{ '<|im_start|>system\n' }}{% for m in messages %}{% if m['role'] == 'system' %}"
    "{{ m['content'] + '\n' }}{% endif %}{% endfor %}{{ '<|im_end|>\n' }}"
    "{% set loop_messages = messages | rejectattr('role', 'equalto', 'system') | list %}" + _TURNS
)


def tokenizer_with(path: Path, template: str):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    build_tokenizer(path, template)
    return load_tokenizer(path)


@pytest.fixture(scope="module")
def rejecting_tokenizer(tmp_path_factory):
    return tokenizer_with(tmp_path_factory.mktemp("rejecting"), REJECTING)


def test_probe_tells_templates_apart(tmp_path, tiny_tokenizer, rejecting_tokenizer):
    dropping = tokenizer_with(tmp_path / "drop", DROPPING)
    hoisting = tokenizer_with(tmp_path / "hoist", HOISTING)
    assert renders_system_in_place(tiny_tokenizer)  # ChatML renders every turn as it comes
    assert not renders_system_in_place(rejecting_tokenizer)
    assert not renders_system_in_place(dropping)
    assert not renders_system_in_place(hoisting)
    # through the model's probed template, as its requests render: the same answers
    for tokenizer, in_place in (
        (tiny_tokenizer, True),
        (rejecting_tokenizer, False),
        (dropping, False),
        (hoisting, False),
    ):
        template = load_chat_template(tokenizer)
        assert template is not None
        assert renders_system_in_place(tokenizer, template) is in_place


def test_the_probe_renders_with_the_template_requests_render_with(tiny_tokenizer):
    """A template whose requests render in the server's own environment is probed there
    (its compiled form is the one requests use), not through the tokenizer's."""
    template = load_chat_template(tiny_tokenizer)
    assert template is not None
    probed: list[list[dict]] = []
    render = template.render

    def recording(messages, **kwargs):
        probed.append(messages)
        return render(messages, **kwargs)

    template.render = recording  # type: ignore[method-assign]
    assert renders_system_in_place(tiny_tokenizer, template)
    assert [m["role"] for m in probed[0]].count("system") == 3


def test_fold_keeps_the_order_and_merges_turns_that_meet():
    msgs = [
        {"role": "system", "content": "S0"},
        {"role": "user", "content": "u1"},
        {"role": "system", "content": "S1"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "a1", "tool_calls": [{"id": "c"}]},
        {"role": "system", "content": [{"type": "text", "text": "S2"}]},
        {"role": "assistant", "content": "a2"},
    ]
    assert has_late_system(msgs)
    assert fold_late_system_messages(msgs) == [
        {"role": "system", "content": "S0\n\nS1\n\nS2"},
        {"role": "user", "content": "u1\nu2"},
        {"role": "assistant", "content": "a1\na2", "tool_calls": [{"id": "c"}]},
    ]
    # No system message at the start: one is made there.
    late_only = [{"role": "user", "content": "u"}, {"role": "system", "content": "S"}]
    assert fold_late_system_messages(late_only) == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "u"},
    ]
    # Leading system messages alone are not late: nothing changes.
    leading = [{"role": "system", "content": "a"}, {"role": "system", "content": "b"}]
    assert not has_late_system(leading + [{"role": "user", "content": "u"}])
    assert fold_late_system_messages(leading) is leading


CLAUDE_CODE_TURNS = {
    "model": "claude-opus-4-8",
    "max_tokens": 16,
    "system": [{"type": "text", "text": "You are an agent."}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What does a.py print?"}]},
        {"role": "system", "content": "Agent types: Explore, Plan."},
    ],
}


def _prompt(srv) -> str:
    return srv.service.tokenizer.decode(srv.engine.requests[-1].prompt_tokens)


def _count(srv, body: dict) -> int:
    keep = ("model", "system", "messages", "tools", "thinking")
    r = httpx.post(
        srv.base_url + "/v1/messages/count_tokens?beta=true",
        json={k: v for k, v in body.items() if k in keep},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


def test_in_place_where_the_template_allows(scripted):
    scripted.engine.push("It prints 1.")
    sdk = anthropic.Anthropic(base_url=scripted.base_url, api_key="x", max_retries=0)
    out = sdk.messages.create(**CLAUDE_CODE_TURNS)
    assert out.content[0].text == "It prints 1."
    prompt = _prompt(scripted)
    assert prompt == (
        "<|im_start|>system\nYou are an agent.<|im_end|>\n"
        "<|im_start|>user\nWhat does a.py print?<|im_end|>\n"
        "<|im_start|>system\nAgent types: Explore, Plan.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert out.usage.input_tokens == _count(scripted, CLAUDE_CODE_TURNS)


def test_folded_where_the_template_rejects_a_later_system_message(rejecting_tokenizer):
    srv = start_in_process(rejecting_tokenizer, ctx_size=512)
    try:
        body = {
            **CLAUDE_CODE_TURNS,
            "messages": [
                *CLAUDE_CODE_TURNS["messages"],
                {"role": "assistant", "content": "Reading it."},
                {"role": "user", "content": "And b.py?"},
                {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
            ],
        }
        srv.engine.push("ok")
        r = httpx.post(srv.base_url + "/v1/messages?beta=true", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert _prompt(srv) == (
            "<|im_start|>system\nYou are an agent.\n\nAgent types: Explore, Plan.\n\n"
            "Be brief.<|im_end|>\n"
            "<|im_start|>user\nWhat does a.py print?<|im_end|>\n"
            "<|im_start|>assistant\nReading it.<|im_end|>\n"
            "<|im_start|>user\nAnd b.py?<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        assert r.json()["usage"]["input_tokens"] == _count(srv, body)
        # The OpenAI route folds the same way (its system/developer messages may come late).
        srv.engine.push("ok")
        chat = {
            "model": "m",
            "messages": [
                {"role": "user", "content": "u"},
                {"role": "developer", "content": "D"},
            ],
        }
        r = httpx.post(srv.base_url + "/v1/chat/completions", json=chat, timeout=30)
        assert r.status_code == 200, r.text
        assert _prompt(srv).startswith("<|im_start|>system\nD<|im_end|>\n<|im_start|>user\nu")
    finally:
        srv.stop()


def test_a_template_without_a_system_role_gets_the_system_text_in_the_first_user_turn(tmp_path):
    """A template that refuses every system message: the template probe moves the system
    text (top-level and late) into the first user turn, so the request still works."""
    no_system = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}{% endfor %}"
        "{% set loop_messages = messages %}" + _TURNS
    )
    srv = start_in_process(tokenizer_with(tmp_path / "nosys", no_system), ctx_size=512)
    try:
        r = httpx.post(srv.base_url + "/v1/messages", json=CLAUDE_CODE_TURNS, timeout=30)
        assert r.status_code == 200, r.text
        prompt = _prompt(srv)
        assert "You are an agent." in prompt and "Agent types: Explore, Plan." in prompt
        assert prompt.index("You are an agent.") < prompt.index("What does a.py print?")
    finally:
        srv.stop()


def test_a_template_that_needs_the_server_s_variables_is_probed_with_them():
    """Firefunction v2's template reads ``functions`` and ``datetime``, which the server's
    template supplies and a bare render does not: probed through the server's template, its
    system turns are seen rendered in place (a bare render raised, which read as "fold")."""
    source = Path(__file__).parents[1] / "data/templates/fireworks-ai-llama-3-firefunction-v2.jinja"
    template = ChatTemplate({"default": source.read_text()}, {"bos_token": "<s>"})
    assert renders_system_in_place(None, template)
