"""``ignore_eos`` (llama.cpp's: generate max tokens whatever the model says) reaches the
engine from every generating API, not only chat completions: benchmarks and tests on
random-weight models rely on it for their token counts."""

from __future__ import annotations

import httpx
import pytest

BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    "/v1/completions": {"prompt": "hi", "max_tokens": 3},
    "/v1/responses": {"input": "hi", "max_output_tokens": 3},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
}


@pytest.mark.parametrize("path", list(BODIES))
@pytest.mark.parametrize("ignore_eos", [True, False, None])
def test_every_api_passes_ignore_eos_to_the_engine(scripted, path, ignore_eos):
    scripted.engine.push("a", "b", "c")
    body = {"model": "m", **BODIES[path]}
    if ignore_eos is not None:
        body["ignore_eos"] = ignore_eos
    before = len(scripted.engine.requests)
    r = httpx.post(scripted.base_url + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert "ignore_eos" not in r.headers.get("x-mlx-server-ignored-fields", "")
    assert len(scripted.engine.requests) == before + 1
    assert scripted.engine.requests[-1].ignore_eos is bool(ignore_eos)
