"""The architecture matrix: every family of tests/helpers/arch_models.py served by one real server
process (one ``-m`` per family, each loaded on its first request by the registry), through
every API and generation path. Greedy output is token for token mlx-lm's own.

Rows for other features parametrize over ``FAMILY_NAMES`` and take a family's directory from
the ``arch_model_dirs`` fixture (conftest.py), or its id on the ``matrix`` server here.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest
from arch_models import FAMILIES
from payloads import closed_object
from support import ServerProcess, free_port, launch

pytestmark = pytest.mark.tiny

FAMILY_NAMES = list(FAMILIES)
USER = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "ignore_eos": True}
# One bounded value: a random-weight model fills a free string until max_tokens.
SCHEMA = closed_object({"ok": {"type": "boolean"}})
GRAMMAR_TOKENS = 64
# The answer itself, not a reasoning block the model may end anywhere.
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": SCHEMA,
    },
}
DEADLINE = 60.0
# What the server logs for a failed request or step (a 500, a stream ended by an error).
ERROR_SIGNS = ("Traceback", "Error processing", " ERROR", "failed")


@pytest.fixture(scope="module")
def matrix(arch_model_dirs: dict[str, Path]) -> Iterator[ServerProcess]:
    """One server for every family (model id: the family's name); no disk tier."""
    args = [a for name in FAMILY_NAMES for a in ("-m", str(arch_model_dirs[name]))]
    args += ["--ctx-size", "4096", "--kv-budget-gb", "0.05", "--prompt-cache-gb", "0.02"]
    args += ["--prompt-cache-dir", "", "--port", str(free_port())]
    srv = launch(args)
    assert srv.wait_ready(300), srv.lines
    yield srv
    srv.stop()
    if os.environ.get("ARCH_MATRIX_LOG"):  # the server's log, to read after a failure
        Path(os.environ["ARCH_MATRIX_LOG"]).write_text("\n".join(srv.lines))


def oai(srv: ServerProcess) -> openai.OpenAI:
    # No retries: a 5xx must show, not be retried away.
    return openai.OpenAI(
        base_url=srv.base_url + "/v1",
        api_key="x",
        max_retries=0,
        timeout=120,
        _strict_response_validation=True,
    )


def chat_body(name: str, max_tokens: int = 4, **extra) -> dict:
    return {"model": name, "messages": USER, "max_tokens": max_tokens, **GREEDY, **extra}


def stream_chat(srv: ServerProcess, body: dict, first: threading.Event | None = None) -> int:
    """Stream a chat completion to its end; the completion tokens its usage reports."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    usage = -1
    url = srv.base_url + "/v1/chat/completions"
    with httpx.stream("POST", url, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            assert not line.startswith("error:"), line
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[len("data: ") :])
            assert "error" not in data, data
            if data["choices"] and first is not None:
                first.set()
            if data.get("usage"):
                usage = data["usage"]["completion_tokens"]
    return usage


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_lone_request_stream_and_not(matrix: ServerProcess, name: str) -> None:
    client = oai(matrix)
    extra = {"ignore_eos": True}
    r = client.chat.completions.create(
        model=name, messages=USER, max_tokens=4, temperature=0, extra_body=extra
    )
    assert r.model == name
    assert r.usage is not None and r.usage.completion_tokens == 4
    assert r.choices[0].finish_reason in ("length", "tool_calls", "stop")
    chunks = list(
        client.chat.completions.create(
            model=name,
            messages=USER,
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == r.choices[0].finish_reason


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_four_streams_joined_mid_decode_by_a_fifth(matrix: ServerProcess, name: str) -> None:
    firsts = [threading.Event() for _ in range(4)]
    with ThreadPoolExecutor(5) as pool:
        running = [
            pool.submit(stream_chat, matrix, chat_body(name, 12, seed=i), first)
            for i, first in enumerate(firsts)
        ]
        for first in firsts:
            assert first.wait(DEADLINE)
        late = pool.submit(stream_chat, matrix, chat_body(name, 6))
        assert [f.result(DEADLINE) for f in running] == [12] * 4
        assert late.result(DEADLINE) == 6


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_n_choices(matrix: ServerProcess, name: str) -> None:
    r = oai(matrix).chat.completions.create(
        model=name, messages=USER, max_tokens=3, n=2, temperature=0.8, seed=1,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage is not None and r.usage.completion_tokens == 6


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_logprobs(matrix: ServerProcess, name: str) -> None:
    r = oai(matrix).chat.completions.create(
        model=name, messages=USER, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = r.choices[0].logprobs and r.choices[0].logprobs.content
    assert content is not None and len(content) == 3
    for entry in content:
        assert len(entry.top_logprobs) == 2
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_json_schema_response(
    matrix: ServerProcess, arch_model_dirs: dict[str, Path], name: str
) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    r = oai(matrix).chat.completions.create(
        model=name, messages=USER, max_tokens=GRAMMAR_TOKENS, temperature=0, response_format=fmt,
        extra_body={**NO_THINKING, **compact(arch_model_dirs[name])},  # type: ignore[arg-type]
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), SCHEMA)


@cache
def tokenizer_of(model_dir: Path):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return load_tokenizer(model_dir)


def compact(model_dir: Path) -> dict[str, dict[str, int]]:
    """A logit bias against whitespace-only tokens: the grammar's JSON comes out compact
    instead of with the most whitespace each gap allows."""
    tokenizer = tokenizer_of(model_dir)
    ids = range(len(tokenizer._tokenizer))
    blank = [i for i in ids if (t := tokenizer.decode([i])) and not t.strip()]
    return {"logit_bias": {str(i): -100 for i in blank}}


def enforces_tool_calls(model_dir: Path) -> bool:
    """Whether the server constrains a forced tool choice for this model: JSON-body calls
    only; other formats take ``tool_choice`` as advice (and log so)."""
    from mlx_server.parsing.tool_formats import resolve_tool_parser

    fmt = resolve_tool_parser(None, tokenizer_of(model_dir))
    return fmt is not None and fmt.name == "json_tools"


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_tools(matrix: ServerProcess, arch_model_dirs: dict[str, Path], name: str) -> None:
    client = oai(matrix)
    # Offered: any answer, text or call, in a valid shape.
    r = client.chat.completions.create(
        model=name, messages=USER, max_tokens=8, temperature=0, tools=[TOOL],  # type: ignore[list-item]
    )  # fmt: skip
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # Forced: a call of the named tool whose arguments match its schema.
    forced = {"type": "function", "function": {"name": "get_weather"}}
    enforced = enforces_tool_calls(arch_model_dirs[name])
    r = client.chat.completions.create(
        model=name, messages=USER, max_tokens=GRAMMAR_TOKENS if enforced else 8, temperature=0,
        tools=[TOOL], tool_choice=forced,
        extra_body={**NO_THINKING, **compact(arch_model_dirs[name])},  # type: ignore[list-item, arg-type]
    )  # fmt: skip
    if not enforced:
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        return
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    assert calls is not None and [c.function.name for c in calls] == ["get_weather"]  # type: ignore[union-attr]
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMA)  # type: ignore[union-attr]


def active(srv: ServerProcess, name: str) -> int | None:
    return httpx.get(srv.base_url + "/health").json()["models"][name].get("active")


def until(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_cancel_mid_stream_frees_the_slot(matrix: ServerProcess, name: str) -> None:
    body = {**chat_body(name, 1000), "stream": True}
    with httpx.stream("POST", matrix.base_url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: a dropped iterator closes the connection
        assert next(lines).startswith("data: {")  # the opening chunk
        # Decoding (a random model's first tokens may all be held-back whitespace).
        until(lambda: active(matrix, name) == 1, "the request never ran")
    # The client went away mid-stream.
    until(lambda: active(matrix, name) == 0, "the cancelled request kept its slot")
    assert stream_chat(matrix, chat_body(name, 2)) == 2


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_anthropic_messages(matrix: ServerProcess, name: str) -> None:
    client = anthropic.Anthropic(
        base_url=matrix.base_url, api_key="x", max_retries=0, _strict_response_validation=True
    )
    msg = client.messages.create(
        model=name,
        max_tokens=4,
        messages=USER,  # type: ignore[arg-type]
        extra_body=GREEDY,
    )
    assert msg.usage.output_tokens == 4
    with client.messages.stream(
        model=name,
        max_tokens=4,
        messages=USER,  # type: ignore[arg-type]
        extra_body=GREEDY,
    ) as stream:
        final = stream.get_final_message()
    assert final.usage.output_tokens == 4 and final.stop_reason == msg.stop_reason


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_responses(matrix: ServerProcess, name: str) -> None:
    client = oai(matrix)
    r = client.responses.create(
        model=name, input="What is the capital of France?", max_output_tokens=16, temperature=0
    )
    assert r.status in ("completed", "incomplete")
    events = list(
        client.responses.create(
            model=name, input="Hello", max_output_tokens=16, temperature=0, stream=True
        )
    )
    assert events[-1].type in ("response.completed", "response.incomplete")


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_greedy_is_mlx_lm_token_for_token(
    matrix: ServerProcess, arch_model_dirs: dict[str, Path], name: str
) -> None:
    """The ground truth: mlx-lm's own greedy steps on the same prompt ids (float32, CPU)."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, tokenizer = load(str(arch_model_dirs[name]))
    prompt = tokenizer.apply_chat_template(USER, add_generation_prompt=True)
    expected = [
        (int(t), float(lp[t])) for t, lp in generate_step(mx.array(prompt), model, max_tokens=8)
    ]

    body = {"model": name, "prompt": prompt, "max_tokens": 8, "logprobs": 0, **GREEDY}
    r = httpx.post(matrix.base_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["logprobs"]
    assert got["tokens"] == [tokenizer.decode([t]) for t, _ in expected]
    assert got["token_logprobs"] == pytest.approx([lp for _, lp in expected], abs=1e-3)


AGENT_SYSTEM = "You are a coding agent. Read the files, run the tests, report tersely. " * 4
AGENT_ANSWER = "<think>The user wants this done.</think>Done."


def agent_messages(turn: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": AGENT_SYSTEM}]
    for i in range(turn + 1):
        msgs.append({"role": "user", "content": f"Step {i}: go on."})
        if i < turn:
            msgs.append({"role": "assistant", "content": AGENT_ANSWER})
    return msgs


def history_length(model_dir: Path, turn: int) -> int:
    """How many leading tokens of ``turn``'s prompt render its history (the conversation
    without the generation prompt): what the next turn can be served from the cache."""
    tokenizer = tokenizer_of(model_dir)
    full = tokenizer.apply_chat_template(agent_messages(turn), add_generation_prompt=True)
    bare = tokenizer.apply_chat_template(agent_messages(turn), add_generation_prompt=False)
    common = next((i for i, (a, b) in enumerate(zip(full, bare, strict=False)) if a != b), None)
    return min(len(full) - 1, common if common is not None else len(bare))


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_an_agent_session_stays_cached(
    matrix: ServerProcess, arch_model_dirs: dict[str, Path], name: str
) -> None:
    """Turns 2 and 3 are served at least the previous turn's history from the RAM tier,
    whatever the cache kind (the template drops earlier turns' reasoning)."""
    cached = []
    for turn in range(3):
        body = {"model": name, "messages": agent_messages(turn), "max_tokens": 2, **GREEDY}
        r = httpx.post(matrix.base_url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    wanted = [history_length(arch_model_dirs[name], t) for t in range(2)]
    assert cached[1] >= wanted[0] and cached[2] >= wanted[1], (cached, wanted)


def test_every_model_s_structured_output_is_prepared_in_idle_time(matrix: ServerProcess) -> None:
    """Each model's grammar tokenizer is wrapped while its engine is idle after the
    readiness line (a first json_schema request does not wait for it), once per model."""
    line = "Idle time: structured output's tokenizer ready"
    for name in FAMILY_NAMES:  # every model loaded (a model loads on its first request)
        r = httpx.post(
            matrix.base_url + "/v1/chat/completions", json=chat_body(name, 1), timeout=120
        )
        assert r.status_code == 200, r.text

    def prepared() -> list[str]:
        return [x for x in matrix.lines if line in x]

    deadline = time.monotonic() + DEADLINE
    while len(prepared()) < len(FAMILY_NAMES):
        assert time.monotonic() < deadline, prepared()
        time.sleep(0.05)
    assert len(prepared()) == len(FAMILY_NAMES)
    models = httpx.get(matrix.base_url + "/health", timeout=10).json()["models"]
    assert {name: m["warming_up"] for name, m in models.items()} == dict.fromkeys(
        FAMILY_NAMES, False
    )


def test_no_server_errors_across_the_matrix(matrix: ServerProcess) -> None:
    """Last: nothing the matrix sent made the server log an error or a traceback."""
    assert httpx.get(matrix.base_url + "/health").json()["status"] == "ok"
    errors = [line for line in matrix.lines if any(s in line for s in ERROR_SIGNS)]
    assert errors == []
