"""Ollama's API on a real ``mlx-server`` process over the tiny random-weight model: the
grammar behind ``format``, the counters of a real generation, parity with /v1/completions,
a client that leaves, and the official ``ollama`` npm package. On random weights the wording
is noise: the tests check structure and agreement between APIs, never text."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import jsonschema
import ollama
import pytest
from ollama_support import CHAT_CHUNK, ERROR, GENERATE_CHUNK, PS, SHOW, TAGS, VERSION, ndjson
from payloads import closed_object

REPO = Path(__file__).resolve().parents[2]
NPM_PACKAGE = REPO / ".cache" / "npm" / "node_modules" / "ollama"
SCHEMA = closed_object({"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}})
GREEDY = {"temperature": 0, "num_predict": 6}


def test_format_with_a_schema_is_enforced(tiny_server):
    c = ollama.Client(host=tiny_server.base_url)
    options = {"temperature": 0, "num_predict": 120}
    r = c.chat(
        model="tiny", messages=[{"role": "user", "content": "hi"}], format=SCHEMA, options=options
    )
    jsonschema.validate(json.loads(r.message.content), SCHEMA)
    g = c.generate(model="tiny", prompt="hi", format="json", options=options)
    assert isinstance(json.loads(g.response), dict)


def test_counters_of_a_real_generation(tiny_server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "options": GREEDY}
    chunks = ndjson(tiny_server.base_url, "/api/chat", body)
    for ch in chunks:
        CHAT_CHUNK.validate(ch)
    done = chunks[-1]
    pieces = [ch for ch in chunks[:-1] if ch["message"]["content"]]
    assert 1 <= done["eval_count"] <= 6 and done["prompt_eval_count"] > 1
    assert done["eval_duration"] > 0 and done["prompt_eval_duration"] > 0
    assert done["total_duration"] >= done["eval_duration"] + done["prompt_eval_duration"]
    assert done["done_reason"] == ("length" if done["eval_count"] == 6 else "stop")
    assert len(pieces) <= done["eval_count"]


def test_raw_generate_matches_v1_completions(tiny_server):
    """The same raw prompt, greedy, through both APIs: the same text."""
    prompt = "The sea is"
    body = {"model": "tiny", "prompt": prompt, "raw": True, "stream": False, "options": GREEDY}
    r = httpx.post(tiny_server.base_url + "/api/generate", json=body, timeout=60)
    GENERATE_CHUNK.validate(r.json())
    v1 = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
    ref = httpx.post(tiny_server.base_url + "/v1/completions", json=v1, timeout=60).json()
    assert r.json()["response"] == ref["choices"][0]["text"]


def test_a_client_that_leaves_frees_its_slot(tiny_server):
    body = {"model": "tiny", "prompt": "a", "raw": True, "options": {"num_predict": 200}}
    with httpx.stream("POST", tiny_server.base_url + "/api/generate", json=body, timeout=60) as r:
        next(r.iter_lines())
    deadline = time.monotonic() + 10
    while (
        httpx.get(tiny_server.base_url + "/health").json()["active"] and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert httpx.get(tiny_server.base_url + "/health").json()["active"] == 0


def test_the_ollama_npm_package(tiny_server):
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("npm is not installed (.ci/run installs it and the ollama package)")
    assert NPM_PACKAGE.is_dir(), "run: npm install --prefix .cache/npm ollama@0.6.4 (.ci/run does)"
    script = REPO / "tests" / "helpers" / "js" / "ollama_client.mjs"
    done = subprocess.run(
        ["node", str(script), str(NPM_PACKAGE), tiny_server.base_url],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    CHAT_CHUNK.validate(out["chat"])
    CHAT_CHUNK.validate(out["last"])
    assert out["last"]["done"] and out["streamed"] == out["chat"]["message"]["content"]
    GENERATE_CHUNK.validate(out["generate"])
    color_schema = {k: v for k, v in SCHEMA.items() if k != "required"}
    jsonschema.validate(json.loads(out["format"]["message"]["content"]), color_schema)
    TAGS.validate(out["list"])
    SHOW.validate(out["show"])
    PS.validate(out["ps"])
    VERSION.validate(out["version"])
    assert out["error"]["status"] == 400 and "chat model" in out["error"]["message"]
    ERROR.validate({"error": out["error"]["message"]})


def test_logprobs_ride_on_the_pieces(tiny_server):
    body = {
        "model": "tiny",
        "prompt": "The sea",
        "raw": True,
        "logprobs": True,
        "top_logprobs": 2,
        "options": GREEDY,
    }
    chunks = ndjson(tiny_server.base_url, "/api/generate", body)
    for ch in chunks:
        GENERATE_CHUNK.validate(ch)
    entries = [e for ch in chunks for e in ch.get("logprobs", [])]
    assert len(entries) == chunks[-1]["eval_count"]
    assert all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in entries)
    whole = httpx.post(
        tiny_server.base_url + "/api/chat",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "logprobs": True,
            "stream": False,
            "options": GREEDY,
        },
        timeout=60,
    ).json()
    CHAT_CHUNK.validate(whole)
    assert len(whole["logprobs"]) == whole["eval_count"]
