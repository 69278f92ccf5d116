"""End-to-end: the real ``mlx-server`` process on a tiny random-weight model."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from clients import openai_client
from payloads import chat
from support import free_port, schema_validator

CHUNK = schema_validator("CreateChatCompletionStreamResponse")
COMPLETION = schema_validator("CreateChatCompletionResponse")


def test_greedy_generation_and_schema(e2e_server):
    r = httpx.post(
        e2e_server.base_url + "/v1/chat/completions",
        json=chat("hello", max_tokens=8, temperature=0),
        timeout=60,
    )
    assert r.status_code == 200, r.text
    COMPLETION.validate(r.json())
    body = r.json()
    assert body["usage"]["completion_tokens"] <= 8
    assert body["choices"][0]["finish_reason"] in ("stop", "length")


def test_same_seed_same_text(e2e_server):
    c = openai_client(e2e_server)
    kw = dict(
        model="m",
        messages=[{"role": "user", "content": "tell me"}],
        max_tokens=12,
        temperature=1.0,
        seed=1234,
        extra_body={"ignore_eos": True},  # 12 sampled tokens, whatever the model would end on
    )
    a = c.chat.completions.create(**kw).choices[0].message.content
    b = c.chat.completions.create(**kw).choices[0].message.content
    assert a == b
    others = {
        c.chat.completions.create(**{**kw, "seed": s}).choices[0].message.content for s in (1, 2, 3)
    }
    assert len(others | {a}) > 1  # the seed actually changes the sampling


def test_stream_matches_non_stream_at_temperature_zero(e2e_server):
    c = openai_client(e2e_server)
    kw = dict(
        model="m", messages=[{"role": "user", "content": "abc"}], max_tokens=10, temperature=0
    )
    full = c.chat.completions.create(**kw).choices[0].message.content
    chunks = list(c.chat.completions.create(stream=True, **kw))
    for ch in chunks:
        CHUNK.validate(ch.model_dump(exclude_unset=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == full


def test_length_and_context_limit(e2e_server):
    c = openai_client(e2e_server)
    r = c.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}], max_tokens=3, temperature=0
    )
    assert r.usage.completion_tokens <= 3
    assert r.choices[0].finish_reason == ("length" if r.usage.completion_tokens == 3 else "stop")
    r = httpx.post(
        e2e_server.base_url + "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 300},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    # no max_tokens: runs until EOS or the context (256) is full, then says "length"
    r = c.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "x"}], temperature=0
    )
    total = r.usage.prompt_tokens + r.usage.completion_tokens
    assert total <= 256
    assert r.choices[0].finish_reason == ("length" if total == 256 else "stop")


def test_logprobs(e2e_server):
    r = httpx.post(
        e2e_server.base_url + "/v1/chat/completions",
        json=chat("x", max_tokens=4, temperature=0, logprobs=True, top_logprobs=3),
        timeout=120,
    ).json()
    COMPLETION.validate(r)
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) >= 1
    for e in content:
        assert len(e["top_logprobs"]) == 3
        assert e["logprob"] <= 0
        # greedy: the chosen token is the most likely one
        assert abs(e["logprob"] - e["top_logprobs"][0]["logprob"]) < 1e-4


def test_health_answers_during_generation(e2e_server):
    body = chat("x", max_tokens=200, temperature=0, ignore_eos=True, stream=True)
    url = e2e_server.base_url
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as resp:
        lines = resp.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert "chat.completion.chunk" in first
        # The stream is open and the generation runs: /health answers, and counts it.
        deadline = time.monotonic() + 120
        while True:
            r = httpx.get(url + "/health", timeout=5)
            assert r.status_code == 200 and r.json()["status"] == "ok"
            if r.json()["active"] == 1:
                break
            assert time.monotonic() < deadline, f"no health answer counted the generation: {r.text}"
            time.sleep(0.02)
    # Leaving the stream cancels the generation: the slot comes back.
    deadline = time.monotonic() + 120
    while httpx.get(url + "/health", timeout=5).json()["active"] != 0:
        assert time.monotonic() < deadline, "the generation was not cancelled"
        time.sleep(0.02)


def test_health_says_when_the_idle_time_work_is_done(e2e_server):
    """``warming_up`` turns false once the engine has done what it left for idle time (here
    structured output's tokenizer and the chat template's probe, which the log names); a
    json_schema request then runs."""
    url = e2e_server.base_url
    e2e_server.wait_for_line("Idle time: structured output's tokenizer ready", timeout=60)
    e2e_server.wait_for_line("Idle time: the chat template ready", timeout=60)
    deadline = time.monotonic() + 60
    while (health := httpx.get(url + "/health", timeout=5).json())["warming_up"]:
        assert time.monotonic() < deadline, health
        time.sleep(0.02)
    assert health["warming_up"] is False and health["status"] == "ok"
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}}}
    body = chat("x", max_tokens=8, temperature=0, response_format=fmt)
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_disconnect_frees_the_slot(e2e_server):
    since = len(e2e_server.lines)
    messages = [{"role": "user", "content": "x"}]
    counted = httpx.post(
        e2e_server.base_url + "/v1/chat/completions/count_tokens",
        json={"model": "m", "messages": messages},
        timeout=30,
    ).json()["input_tokens"]
    room = 256 - counted  # no max_tokens: the generation may fill the context
    body = {
        "model": "m",
        "messages": messages,
        "stream": True,
        "temperature": 1.0,
        # Not ending early: what the random model samples never matters (its end-of-turn
        # token may come first), so the generation is still running when the client goes.
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST", e2e_server.base_url + "/v1/chat/completions", json=body, timeout=60
    ) as resp:
        it = resp.iter_lines()
        next(it)
    # The generation was cut short, not run to its end (on a loaded machine the cut may
    # come while the prompt is still being prefilled, or while it is still queued).
    line = e2e_server.wait_for_line(" cancelled ", since, timeout=120)
    generated = 0 if line.endswith(" while queued") else int(line.rsplit(", ", 1)[1].split()[0])
    assert generated < room, line
    deadline = time.time() + 30
    while time.time() < deadline and httpx.get(e2e_server.base_url + "/health").json()["active"]:
        time.sleep(0.05)
    assert httpx.get(e2e_server.base_url + "/health").json()["active"] == 0


def test_readiness_only_after_bind_and_sigterm(tiny_model_dir, server_factory):
    port = free_port()
    sp = server_factory(
        ["-m", str(tiny_model_dir), "--port", str(port), "--model-id", "my.model-1.5"]
    )
    # the readiness line was printed: the port must already accept connections
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    deadline = time.time() + 5
    while time.time() < deadline and not any(
        line == f"[mlx] server is listening on 127.0.0.1:{port}" for line in sp.lines
    ):
        time.sleep(0.05)
    assert any(line == f"[mlx] server is listening on 127.0.0.1:{port}" for line in sp.lines)
    assert httpx.get(sp.base_url + "/v1/models").json()["data"][0]["id"] == "my.model-1.5"
    # a long generation is running when SIGTERM arrives
    t = threading.Thread(
        target=lambda: httpx.post(
            sp.base_url + "/v1/chat/completions",
            json=chat("x", stream=True, max_tokens=3000, ignore_eos=True),
            timeout=30,
        )
    )
    t.start()
    deadline = time.time() + 30
    while time.time() < deadline and not httpx.get(sp.base_url + "/health").json()["active"]:
        time.sleep(0.02)
    assert httpx.get(sp.base_url + "/health").json()["active"] == 1
    t0 = time.time()
    sp.proc.send_signal(signal.SIGTERM)
    sp.proc.wait(10)
    assert time.time() - t0 < 5
    t.join(10)


def test_port_in_use(tiny_model_dir, server_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        sp = server_factory(["-m", str(tiny_model_dir), "--port", str(port)], wait=False)
        rc = sp.proc.wait(60)
    assert rc != 0
    assert not any("http server listening" in line for line in sp.lines)
    assert "in use" in sp.stderr_text().lower()


def test_load_failure(tmp_path, server_factory):
    sp = server_factory(["-m", str(tmp_path / "missing"), "--port", str(free_port())], wait=False)
    assert sp.wait_exit(60) == 1
    assert any(line.startswith("[mlx] Failed to load model:") for line in sp.lines)
    assert not any("listening" in line for line in sp.lines)
    assert sp.stderr_text().strip()


def test_unknown_flag_exits_2(server_factory):
    sp = server_factory(["-m", "x", "--no-such-flag", "y"], wait=False)
    assert sp.proc.wait(30) == 2
    assert "usage" in sp.stderr_text().lower()


def test_default_model_id_keeps_dots(tmp_path, tiny_model_dir, server_factory):
    import shutil

    d = tmp_path / "Qwen2.5-7B"
    shutil.copytree(tiny_model_dir, d)
    port = free_port()
    sp = server_factory(["-m", str(d / "model.safetensors"), "--port", str(port)])
    assert httpx.get(sp.base_url + "/v1/models").json()["data"][0]["id"] == "Qwen2.5-7B"


def test_non_loopback_warning(tiny_model_dir, server_factory):
    port = free_port()
    sp = server_factory(["-m", str(tiny_model_dir), "--port", str(port), "--host", "0.0.0.0"])
    assert any("WARNING" in line and "API key" in line for line in sp.lines)
    assert json.loads(httpx.get(f"http://127.0.0.1:{port}/health").text)["status"] == "ok"


def test_unknown_tool_call_parser_lists_valid_names(server_factory):
    sp = server_factory(["-m", "x", "--tool-call-parser", "bogus"], wait=False)
    assert sp.proc.wait(30) == 2
    err = sp.stderr_text()
    assert "bogus" in err and "json_tools" in err and "mistral" in err


def test_hf_repo_id_offline_fails_clearly(server_factory, tmp_path):
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    sp = server_factory(
        ["-m", "some-org/some-model", "--port", str(free_port())], wait=False, env=env
    )
    assert sp.proc.wait(60) == 1
    err = sp.stderr_text()
    assert "some-org/some-model" in err and "offline" in err.lower()


@pytest.mark.demo
def test_serves_a_gguf_file_directly(server_factory, tmp_path):
    gguf = Path(__file__).resolve().parents[2] / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert gguf.is_file(), "run mlx-server-demo first"
    env = {"MLX_SERVER_CACHE": str(tmp_path / "cache")}
    sp = server_factory(
        ["-m", str(gguf), "--port", str(free_port()), "--dtype", "float32"], env=env
    )
    assert (
        httpx.get(sp.base_url + "/v1/models").json()["data"][0]["id"]
        == "SmolLM2-135M-Instruct.Q4_1"
    )
    r = httpx.post(
        sp.base_url + "/v1/chat/completions",
        json=chat("What is the capital of France?", temperature=0, max_tokens=20),
        timeout=120,
    )
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
    assert any((tmp_path / "cache").rglob("model.safetensors"))


def test_non_gguf_file_named_gguf_fails_clearly(server_factory, tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 100)
    sp = server_factory(
        ["-m", str(bad), "--port", str(free_port())],
        wait=False,
        env={"MLX_SERVER_CACHE": str(tmp_path / "c")},
    )
    assert sp.wait_exit(60) == 1
    assert any(line.startswith("[mlx] Failed to load model:") for line in sp.lines)
    assert "gguf" in sp.stderr_text().lower()


def test_ignore_eos_generates_max_tokens(e2e_server):
    body = chat("Say hi.", max_tokens=40, temperature=0, ignore_eos=True)
    r = httpx.post(e2e_server.base_url + "/v1/chat/completions", json=body, timeout=120).json()
    assert r["usage"]["completion_tokens"] == 40
    assert r["choices"][0]["finish_reason"] == "length"
