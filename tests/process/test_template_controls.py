"""``continue_final_message`` and ``add_generation_prompt`` (vLLM's chat-template controls):
rendered as Hugging Face renders them, continued on the demo model, and validated."""

from __future__ import annotations

import httpx
import openai
import pytest
from support import ServerProcess, demo_model_dir

CONVERSATION = [
    {"role": "user", "content": "Count from one to ten in words."},
    {"role": "assistant", "content": "One, two, three,"},
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir())


def ours(tokenizer, messages, **flags) -> str:
    from mlx_server.models.chat_template import load_chat_template
    from mlx_server.models.prompt import render_prompt

    return render_prompt(tokenizer, messages, template=load_chat_template(tokenizer), **flags)


@pytest.mark.demo
def test_rendering_matches_hugging_face(hf_tokenizer):
    cont = ours(hf_tokenizer, CONVERSATION, continue_final_message=True)
    assert cont == hf_tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False, continue_final_message=True
    )
    assert cont.endswith("One, two, three,")
    closed = ours(hf_tokenizer, CONVERSATION, add_generation_prompt=False)
    assert closed == hf_tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    user_only = CONVERSATION[:1]
    assert ours(
        hf_tokenizer, user_only, add_generation_prompt=False
    ) + "<|im_start|>assistant\n" == (ours(hf_tokenizer, user_only))


def test_trailing_space_and_parts_of_the_final_message():
    from mlx_server.errors import InvalidRequest
    from mlx_server.models.prompt import open_final_message

    text = "<u>hi</u><a>Sure: </a>\n"
    assert open_final_message(text, {"content": "Sure: "}) == "<u>hi</u><a>Sure: "
    trimmed = "<u>hi</u><a>Sure:</a>\n"  # a template that strips the message
    assert open_final_message(trimmed, {"content": "Sure: "}) == "<u>hi</u><a>Sure:"
    parts = {"content": [{"type": "text", "text": "x"}, {"type": "text", "text": "Sure:"}]}
    assert open_final_message(trimmed, parts) == "<u>hi</u><a>Sure:"
    with pytest.raises(InvalidRequest):
        open_final_message(text, {"content": "not rendered"})
    with pytest.raises(InvalidRequest):
        open_final_message(text, {"content": "  "})


@pytest.fixture
def demo(demo_server: ServerProcess) -> ServerProcess:
    return demo_server  # the session's demo-model server (conftest.py)


@pytest.mark.demo
def test_continue_final_message_continues_the_assistant_prefix(demo, hf_tokenizer):
    client = openai.OpenAI(
        base_url=f"{demo.base_url}/v1",
        api_key="x",
        max_retries=0,
        _strict_response_validation=True,
    )
    out = client.chat.completions.create(
        model="demo",
        messages=CONVERSATION,
        temperature=0,
        max_tokens=8,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    prefix = hf_tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False, continue_final_message=True
    )
    ids = hf_tokenizer.encode(prefix, add_special_tokens=False)
    raw = httpx.post(
        f"{demo.base_url}/v1/completions",
        json={"prompt": ids, "temperature": 0, "max_tokens": 8},
        timeout=120,
    ).json()
    # The same tokens as a raw completion of the open assistant turn: no new turn opened.
    assert out.choices[0].message.content == raw["choices"][0]["text"]
    assert out.usage.prompt_tokens == len(ids)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
        ({"continue_final_message": True}, "messages"),  # the last message is the user's
    ],
)
def test_invalid_combinations_are_400(scripted, extra, param):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    r = httpx.post(f"{scripted.base_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    if "add_generation_prompt" in extra:
        assert "Cannot set both" in r.json()["error"]["message"]


def test_continue_alone_is_accepted(scripted):
    body = {"messages": CONVERSATION, "max_tokens": 2, "continue_final_message": True}
    r = httpx.post(f"{scripted.base_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    prompt = scripted.engine.requests[-1].prompt_tokens
    assert scripted.service.tokenizer.decode(prompt).endswith("One, two, three,")
