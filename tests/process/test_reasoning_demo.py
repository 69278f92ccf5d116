"""The demo model behind a chat template that opens a think block in the prompt."""

from __future__ import annotations

import json

import httpx
import pytest
from payloads import chat
from support import demo_model_dir, free_port

pytestmark = pytest.mark.demo

OPENER = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


def test_template_opened_think_block_is_reasoning(tmp_path, server_factory):
    src = demo_model_dir()
    model = tmp_path / "smollm2-think"
    model.mkdir()
    for f in src.iterdir():
        (model / f.name).symlink_to(f)
    (model / "chat_template.jinja").write_text(OPENER)
    sp = server_factory(["-m", str(model), "--port", str(free_port())])
    body = chat("What is 2+2?", temperature=0, max_tokens=24)
    r = httpx.post(sp.base_url + "/v1/chat/completions", json=body, timeout=120).json()
    msg = r["choices"][0]["message"]
    assert msg.get("reasoning_content")
    assert "<think>" not in (msg["content"] or "")
    # streamed: the same split
    with httpx.stream(
        "POST", sp.base_url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120
    ) as resp:
        deltas = [
            json.loads(x[6:])["choices"] for x in resp.iter_lines() if x.startswith("data: {")
        ]
    reasoning = "".join(c[0]["delta"].get("reasoning_content") or "" for c in deltas if c)
    content = "".join(c[0]["delta"].get("content") or "" for c in deltas if c)
    assert reasoning == msg["reasoning_content"] and content == msg["content"]
