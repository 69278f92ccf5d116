"""Sharded serving on real processes: two ranks on this host (``mlx.launch``, the ring backend
over 127.0.0.1) serve the demo model split across them. Their outputs are the single-process
server's; cancellation and the prefix cache work; SIGTERM ends every rank; a rank killed
ends the server with an error instead of a hang."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from payloads import closed_object
from support import ServerProcess, demo_model_dir, free_port, launch

from mlx_server.boot.ranks import free_ports

# Sharded servers of several processes (up to 300 s to start) and long generations.
pytestmark = [pytest.mark.demo, pytest.mark.timeout(600)]

BIN = Path(sys.executable).parent
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Say hello in Spanish.",
]
MAX_TOKENS = 16


def rank_env() -> dict[str, str]:
    # Two ranks share the machine's cores: one BLAS thread each (CPU float32 matmuls).
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OPENBLAS_NUM_THREADS": "1"}


class Launched(ServerProcess):
    """A server process given an open stdin (mlx.launch polls its stdin: a closed one or
    /dev/null would be read without end)."""

    def stop(self) -> None:
        super().stop()
        if self.proc.stdin is not None:
            self.proc.stdin.close()


def start(cmd: list[str], port: int) -> Launched:
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=rank_env(),
    )
    sp = Launched(proc, port)
    sp._pumping = threading.Thread(target=sp._pump, daemon=True)
    sp._pumping.start()
    return sp


def launch_ranks(args: list[str], n: int = 2) -> Launched:
    """``mlx.launch -n N --backend ring mlx-server ARGS --port P``, the documented form (with
    free ring ports)."""
    port = free_port()
    cmd = [str(BIN / "mlx.launch"), "-n", str(n), "--backend", "ring"]
    cmd += ["--starting-port", str(free_ports(n)), str(BIN / "mlx-server")]
    return start([*cmd, *args, "--port", str(port)], port)


def ready(sp: Launched) -> Launched:
    assert sp.wait_ready(300), "\n".join(sp.lines)
    return sp


def rank_pids(sp: ServerProcess) -> list[int]:
    line = sp.wait_for_line("Ranks: all 2 loaded", timeout=60)
    return [int(p) for p in re.findall(r"\d+", line.split("pids", 1)[1])]


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    if stat.exists():
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False
    return True


def all_gone(pids: list[int], timeout: float = 60) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not any(running(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def body(prompt: str, **kw) -> dict:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        **kw,
    }


def complete(srv: ServerProcess, payload: dict) -> dict:
    r = httpx.post(srv.base_url + "/v1/chat/completions", json=payload, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def stream_text(srv: ServerProcess, payload: dict) -> tuple[str, str]:
    """The streamed answer's text and finish reason (official SDK, strict)."""
    c = openai.OpenAI(
        base_url=srv.base_url + "/v1",
        api_key="x",
        _strict_response_validation=True,
        max_retries=0,
        timeout=300,
    )
    text, reason = "", ""
    kw = {k: v for k, v in payload.items() if k not in ("model", "messages", "max_tokens")}
    for chunk in c.chat.completions.create(
        model=payload["model"],
        messages=payload["messages"],
        max_tokens=payload["max_tokens"],
        stream=True,
        **kw,
    ):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reason = choice.finish_reason or reason
    return text, reason


def answer(r: dict) -> tuple[str, str]:
    choice = r["choices"][0]
    return choice["message"]["content"], choice["finish_reason"]


def wait_idle(srv: ServerProcess, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if httpx.get(srv.base_url + "/health", timeout=10).json()["active"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError("the server still has active generations")


@pytest.fixture(scope="module")
def reference() -> dict:
    """The single-process server's greedy answers, one request at a time, and a seeded one:
    what the ranks must reproduce."""
    port = free_port()
    single = launch(["-m", str(demo_model_dir()), "--port", str(port)])
    try:
        assert single.wait_ready(300), single.lines
        out = {p: answer(complete(single, body(p))) for p in PROMPTS}
        out["seeded"] = answer(complete(single, body(PROMPTS[1], temperature=0.8, seed=7)))
    finally:
        single.stop()
    return out


def start_ranks(model: Path, *flags: str) -> Launched:
    """``mlx-server --model MODEL --ranks 2 ... --port P`` (this server starts the ranks)."""
    port = free_port()
    cmd = [sys.executable, "-m", "mlx_server", "--model", str(model), "--ranks", "2"]
    return start([*cmd, *flags, "--port", str(port)], port)


@pytest.fixture(scope="module")
def sharded():
    sp = ready(start_ranks(demo_model_dir()))
    yield sp
    sp.stop()


def test_ranks_split_the_model_and_serve_once_all_loaded(sharded):
    out = "\n".join(sharded.lines)
    assert "Sharding: pipeline parallel" in out
    assert "rank 1: Sharding: pipeline parallel" in out
    # The readiness line comes after the barrier that every rank reaches once loaded.
    barrier = sharded.lines.index(sharded.wait_for_line("Ranks: all 2 loaded"))
    ready_at = sharded.lines.index(sharded.wait_for_line("http server listening"))
    assert barrier < ready_at
    assert len(rank_pids(sharded)) == 2


def test_greedy_answers_match_the_single_process(sharded, reference):
    for p in PROMPTS:
        assert answer(complete(sharded, body(p))) == reference[p], p


def test_streamed_answers_match_the_single_process(sharded, reference):
    for p in PROMPTS[:2]:
        assert stream_text(sharded, body(p)) == reference[p], p


def test_four_concurrent_requests_match_the_single_process(sharded, reference):
    def one(i: int) -> tuple[str, str]:
        payload = body(PROMPTS[i])
        return stream_text(sharded, payload) if i % 2 else answer(complete(sharded, payload))

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(one, range(4)))
    assert got == [reference[p] for p in PROMPTS]
    wait_idle(sharded)


def test_seeded_sampling_matches_the_single_process(sharded, reference):
    seeded = body(PROMPTS[1], temperature=0.8, seed=7)
    assert answer(complete(sharded, seeded)) == reference["seeded"]


def test_a_repeated_prompt_hits_the_prefix_cache_on_every_rank(sharded, reference):
    long = body(PROMPTS[0] + " Answer in one short sentence, please, and be precise.")
    first = complete(sharded, long)
    again = complete(sharded, long)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert answer(again) == answer(first)
    assert answer(complete(sharded, body(PROMPTS[0]))) == reference[PROMPTS[0]]


def test_structured_output_is_enforced_on_rank_0(sharded):
    schema = closed_object({"city": {"type": "string"}})
    payload = body(
        PROMPTS[0],
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    text, reason = answer(complete(sharded, payload))
    assert reason == "stop"
    assert set(json.loads(text)) == {"city"}


def test_client_disconnect_and_cancel_free_their_slots(sharded, reference):
    since = len(sharded.lines)
    long = body(PROMPTS[1], max_tokens=2000, ignore_eos=True, stream=True)
    with httpx.stream(
        "POST", sharded.base_url + "/v1/chat/completions", json=long, timeout=300
    ) as resp:
        it = resp.iter_lines()
        while not next(it).startswith("data: {"):
            pass
    sharded.wait_for_line(" cancelled ", since, timeout=120)
    wait_idle(sharded)

    since = len(sharded.lines)
    done: list[dict] = []
    t = threading.Thread(
        target=lambda: done.append(
            complete(sharded, body(PROMPTS[2], max_tokens=2000, ignore_eos=True))
        )
    )
    t.start()
    deadline = time.time() + 120
    while time.time() < deadline:
        if httpx.get(sharded.base_url + "/health", timeout=10).json()["active"]:
            break
        time.sleep(0.05)
    r = httpx.post(sharded.base_url + "/v1/cancel", json={}, timeout=30).json()
    assert r["cancelled_count"] == 1
    t.join(120)
    assert done and done[0]["usage"]["completion_tokens"] < 2000
    wait_idle(sharded)
    # Both ranks dropped the sequences together: the next answers are still right.
    assert answer(complete(sharded, body(PROMPTS[3]))) == reference[PROMPTS[3]]


def test_sigterm_to_rank_0_ends_every_rank(sharded):
    """Last of the shared server's tests: it ends that server."""
    pids = rank_pids(sharded)
    os.kill(pids[0], signal.SIGTERM)
    assert all_gone(pids), "a rank outlived SIGTERM to rank 0"
    assert sharded.wait_exit(60) == 0  # a stop that was asked for
    sharded.wait_for_line("rank 1: Ranks: rank 0 said stop")  # the pump may still be reading


def test_mlx_launch_form_serves_and_sigterm_to_the_launcher_ends_every_rank(tiny_model_dir):
    sp = ready(launch_ranks(["--model", str(tiny_model_dir), "--shard", "tensor"]))
    pids = rank_pids(sp)
    try:
        # rank 1's lines reach mlx.launch's output on their own pipe: maybe after rank 0's
        sp.wait_for_line("rank 1: Sharding: tensor parallel")
        payload = body("hello", max_tokens=8, ignore_eos=True)
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda _: complete(sp, payload), range(2)))
        assert [r["usage"]["completion_tokens"] for r in got] == [8] * 2
        assert len({r["choices"][0]["message"]["content"] for r in got}) == 1  # greedy
        sp.proc.send_signal(signal.SIGTERM)  # mlx.launch dies at once; its ranks see it go
        assert all_gone(pids), "ranks left running after mlx.launch was stopped"
    finally:
        sp.stop()


def test_a_killed_rank_ends_the_server_with_an_error(tiny_model_dir):
    sp = ready(start_ranks(tiny_model_dir))
    pids = rank_pids(sp)
    since = len(sp.lines)
    streamed: list[str] = []

    def read() -> None:
        long = body("tell me", max_tokens=3000, ignore_eos=True, stream=True)
        try:
            with httpx.stream(
                "POST", sp.base_url + "/v1/chat/completions", json=long, timeout=120
            ) as resp:
                for line in resp.iter_lines():
                    streamed.append(line)
        except httpx.HTTPError:
            streamed.append("broken")

    try:
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        deadline = time.time() + 120
        while time.time() < deadline and len(streamed) < 3:
            time.sleep(0.05)
        assert len(streamed) >= 3, "the stream did not start"
        os.kill(pids[1], signal.SIGKILL)
        line = sp.wait_for_line("Error: sharded serving stopped on rank 0", since, timeout=30)
        assert f"rank 1 (pid {pids[1]}) exited" in line
        assert all_gone(pids, 30)
        assert sp.wait_exit(60) == 1
        reader.join(60)
        assert not reader.is_alive(), "the client's stream hung after the rank died"
        assert "data: [DONE]" not in streamed
    finally:
        sp.stop()


def test_a_kind_the_model_lacks_is_a_start_up_error():
    sp = start_ranks(demo_model_dir(), "--shard", "tensor")
    try:
        assert sp.wait_exit(300) == 1
        out = "\n".join(sp.lines)
        assert "the model's 9 attention heads do not divide evenly by 2 ranks" in out
        assert "http server listening" not in out
    finally:
        sp.stop()
