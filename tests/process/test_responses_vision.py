"""``input_image`` parts on the Responses API, on a tiny random-weight Qwen2-VL model.

The tiny model's processor gives a 56x56 image 4 tokens and a 112x112 one 16; the tests check
those counts in ``usage.input_tokens`` and that a bad image is a 400 naming its part.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator

import httpx
import openai
import pytest
from PIL import Image
from responses_spec import validate_error, validate_response
from support import serving
from tiny_vlm import build_tiny_vlm


def data_url(w: int, h: int) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (20, 120, 220)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory) -> Iterator:
    model = build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-vlm")
    with serving(["-m", str(model), "--ctx-size", "1024"]) as sp:
        yield sp


def input_tokens(srv, content) -> int:
    c = openai.OpenAI(
        base_url=srv.base_url + "/v1", api_key="x", _strict_response_validation=True, max_retries=0
    )
    r = c.responses.create(
        model="tiny-vlm",
        input=[{"role": "user", "content": content}],
        max_output_tokens=2,
        temperature=0,
    )
    validate_response(httpx.get(f"{srv.base_url}/v1/responses/{r.id}").json())
    assert r.usage is not None
    return r.usage.input_tokens


def test_input_image_tokens_are_counted(vlm_server):
    text = [{"type": "input_text", "text": "What is this?"}]
    plain = input_tokens(vlm_server, text)
    small = input_tokens(
        vlm_server, [{"type": "input_image", "image_url": data_url(56, 56)}, *text]
    )
    large = input_tokens(
        vlm_server,
        [{"type": "input_image", "image_url": data_url(112, 112), "detail": "high"}, *text],
    )
    assert small - plain >= 4 and large - small == 12


def test_bad_image_names_its_part(vlm_server):
    body = {
        "model": "tiny-vlm",
        "input": [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "What is this?"},
                    {"type": "input_image", "image_url": "data:image/png;base64,bm90IGFuIGltYWdl"},
                ],
            }
        ],
    }
    r = httpx.post(vlm_server.base_url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    validate_error(r.json())
    assert r.json()["error"]["param"] == "input[0].content[1]"
    # after a stored conversation, the part is still named by its place in this input
    first = {"model": "tiny-vlm", "input": "Hello", "max_output_tokens": 2}
    prev = httpx.post(vlm_server.base_url + "/v1/responses", json=first, timeout=60).json()
    body["previous_response_id"] = prev["id"]
    r = httpx.post(vlm_server.base_url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "input[0].content[1]"


def test_file_id_images_are_refused(vlm_server):
    body = {
        "model": "tiny-vlm",
        "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}],
    }
    r = httpx.post(vlm_server.base_url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "input[0].content[0].image_url"
    assert "file_id" in r.json()["error"]["message"]
