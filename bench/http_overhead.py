"""What the HTTP side costs per token when the model is fast: the real engine, service and
server around a stand-in for the model that takes a GPU's time per step.

On a GPU a batch of 32 decodes in a few milliseconds, so the Python of everything around the
model (the engine thread's delivery, the event loop's parsers, SSE encoding and socket
writes) decides the throughput, and both threads share one interpreter lock. That cannot be
measured with a real model on a CPU, where a step takes a hundred times longer. Here the
``Engine`` runs a ``PacedRunner``: each step sleeps ``--step-ms`` (the interpreter lock
released, as while MLX waits for the GPU), then spends ``--python-ms`` in Python (holding it,
as mlx-lm's ``BatchGenerator`` does per step), and gives every sequence one token of real
text. The tokenizer, chat template, engine, service, app and uvicorn are the server's own.

Layers, taking turns, N requests at once each:

- ``engine``: the ``Engine``'s handles read on an asyncio loop in this process;
- ``service``: ``ChatService.start`` and ``Generation.events()`` in this process;
- ``http``: streamed chat completions to the same stack behind uvicorn in a child process,
  read by a minimal client (raw sockets) in this one.

The ideal is N tokens per (step + python) milliseconds; each layer's rate is given against
the engine's.

    .venv/bin/python bench/http_overhead.py --n 32 --tokens 256 --reps 3
    .venv/bin/python bench/http_overhead.py --profile /tmp/http.txt    # py-spy the child
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from http_burst import body, http_burst, print_profile, summarize  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = str(ROOT / "models/smollm2-135m-instruct-f32")
TEXT = (
    "The lighthouse keeper climbed the stairs every evening, counting the steps as his father "
    "had, and lit the lamp that ships far out at sea would look for. "
)


class PacedRunner:
    """A runner that takes a fixed time per step and answers one token of ``TEXT`` per
    sequence (the runner interface of ``engine/runners/base.py``)."""

    def __init__(self, token_ids: list[int], a: argparse.Namespace):
        import mlx.core as mx

        self.ids = token_ids
        self.step_s, self.python_s = a.step_ms / 1000, a.python_ms / 1000
        self.prefill_s, self.new_shape_s = a.prefill_ms / 1000, a.new_shape_ms / 1000
        self.seqs: dict[int, list[int]] = {}  # uid -> [emitted, max_tokens]
        self.logprobs = mx.zeros((8,))
        self.joining = 0  # inserted since the last step: they prefill together
        self.shapes: set[int] = set()  # wave sizes met before ("kernels built")
        self.waves: list[int] = []  # the size of each prefill wave

    def insert(self, job: Any) -> None:
        self.seqs[job.uid] = [0, job.request.max_tokens]
        self.joining += 1

    def step(self) -> tuple[list[Any], list[Any]]:
        from mlx_server.engine.runners.base import Response

        device = self.step_s
        if self.joining:  # a prefill pass for the wave; a new wave size builds kernels
            device += self.prefill_s + (self.new_shape_s if self.joining not in self.shapes else 0)
            self.shapes.add(self.joining)
            self.waves.append(self.joining)
            self.joining = 0
        time.sleep(device)  # the device computes; the interpreter lock is free
        end = time.perf_counter() + self.python_s
        while time.perf_counter() < end:  # the batch generator's own Python
            pass
        out = []
        for uid, state in list(self.seqs.items()):
            state[0] += 1
            tok = self.ids[state[0] % len(self.ids)]
            done = state[0] >= state[1]
            out.append(Response(uid, tok, self.logprobs, "length" if done else None))
            if done:
                del self.seqs[uid]
        return [], out

    def remove(self, uids: list[int]) -> dict[int, Any]:
        for u in uids:
            self.seqs.pop(u, None)
        return {}

    def extract_state(self, uids: list[int]) -> dict[int, Any]:
        return {}

    def reset(self) -> None:
        self.seqs.clear()

    def close(self) -> None:
        self.seqs.clear()

    def stats(self) -> dict[str, Any]:
        return {}


def build(a: argparse.Namespace) -> tuple[Any, Any]:
    """The chat service over an ``Engine`` with a paced runner, and its settings."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlx_server.config import Settings
    from mlx_server.engine.core.engine import Engine, EngineConfig
    from mlx_server.service import ChatService

    tokenizer = load_tokenizer(Path(a.tokenizer))
    runner = PacedRunner(tokenizer.encode(TEXT), a)
    kw = {"max_batch_size": a.n, "max_queue": 4 * a.n, "prompt_cache_size": 0}
    if "gather_s" in EngineConfig.__dataclass_fields__:  # not in builds before it
        kw["gather_s"] = a.gather_ms / 1000
    config = EngineConfig(**kw)
    engine = Engine(None, tokenizer, config, runner=runner)
    engine.start()
    service = ChatService("m", tokenizer, engine, ctx_size=4096)
    return service, Settings(model=a.tokenizer, model_id="m", no_webui=True)


def serve_main(a: argparse.Namespace) -> None:
    from fastapi import APIRouter

    from mlx_server.boot.app import app_options, create_app
    from mlx_server.server.run import bind_socket, serve

    if a.switch_ms:  # the interpreter lock's switch interval (Python's default: 5 ms)
        sys.setswitchinterval(a.switch_ms / 1000)
    if a.uvloop:  # an experiment: uvloop's event loop under the server
        import uvloop

        uvloop.install()
    if a.http:  # uvicorn's HTTP implementation (default: httptools when installed, else h11)
        import functools

        import mlx_server.server.run as run

        run.uvicorn.Config = functools.partial(run.uvicorn.Config, http=a.http)  # type: ignore[misc]
    service, settings = build(a)
    waves = APIRouter()

    @waves.get("/bench/waves")
    def take_waves() -> list[int]:  # the prefill waves since the last call
        runner = service.engine._runner
        out, runner.waves = runner.waves, []
        return out

    @waves.get("/bench/cpu")
    async def take_cpu() -> dict[str, float]:  # async: runs on the event loop's thread
        return {"process_s": time.process_time(), "loop_s": time.thread_time()}

    sock = bind_socket("127.0.0.1", a.port)
    app = create_app(service, **app_options(settings), extra=waves)
    serve(app, service.engine, sock, "127.0.0.1", a.port)


async def engine_burst(service: Any, rep: int, n: int, tokens: int) -> dict[str, Any]:
    from mlx_server.engine.core.handle import TokenPiece
    from mlx_server.events import Finished
    from mlx_server.protocols.openai.chat.adapter import to_chat_request
    from mlx_server.protocols.openai.chat.schemas import ChatCompletionRequest

    chats = [
        to_chat_request(ChatCompletionRequest.model_validate(body(rep, i, tokens)))
        for i in range(n)
    ]
    reqs = [service.build_request(c, f"r{rep}-{i}")[0] for i, c in enumerate(chats)]
    loop = asyncio.get_running_loop()

    async def one(req: Any) -> tuple[float, float, int]:
        t_first = t_last = 0.0
        count = 0
        async for ev in service.engine.submit(req, loop):
            if isinstance(ev, TokenPiece) and ev.text:
                t_last = time.perf_counter()
                t_first = t_first or t_last
            elif isinstance(ev, Finished):
                count = ev.usage.completion_tokens
        return t_first, t_last, count

    t0 = time.perf_counter()
    return summarize(t0, list(await asyncio.gather(*[one(r) for r in reqs])))


async def service_burst(service: Any, rep: int, n: int, tokens: int) -> dict[str, Any]:
    from mlx_server.events import Finished
    from mlx_server.protocols.openai.chat.adapter import to_chat_request
    from mlx_server.protocols.openai.chat.schemas import ChatCompletionRequest

    chats = [
        to_chat_request(ChatCompletionRequest.model_validate(body(rep, i, tokens)))
        for i in range(n)
    ]

    async def one(chat: Any) -> tuple[float, float, int]:
        gen = await service.start(chat)
        t_first = t_last = 0.0
        count = 0
        async for ev in gen.events():
            if isinstance(ev, Finished):
                count = ev.usage.completion_tokens
            elif getattr(ev, "text", ""):
                t_last = time.perf_counter()
                t_first = t_first or t_last
        return t_first, t_last, count

    t0 = time.perf_counter()
    return summarize(t0, list(await asyncio.gather(*[one(c) for c in chats])))


def cpu_seconds(pid: int | None = None) -> float:
    """CPU time (user + system) of a process so far: this one's, or ``pid``'s from /proc
    (Linux; 0 elsewhere). On a shared machine the wall-clock rates wander with the load,
    the CPU each token costs much less."""
    if pid is None:
        return time.process_time()
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def rnd(v: Any) -> Any:
    return round(v, 4) if isinstance(v, float) else v


def wait_ready(port: int, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the server exited")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise RuntimeError("the server did not start")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokenizer", default=TOKENIZER)
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--tokens", type=int, default=256, help="generated per request")
    p.add_argument("--step-ms", type=float, default=5.0, help="device time per step")
    p.add_argument("--python-ms", type=float, default=1.0, help="runner's Python per step")
    p.add_argument("--prefill-ms", type=float, default=5.0, help="device time per prefill wave")
    p.add_argument("--new-shape-ms", type=float, default=50.0, help="a wave size met first")
    p.add_argument("--gather-ms", type=float, default=50.0, help="the engine's gather_s")
    p.add_argument("--switch-ms", type=float, default=0, help="the server's switch interval")
    p.add_argument("--http", default="", help="uvicorn's HTTP protocol: h11 or httptools")
    p.add_argument("--uvloop", action="store_true", help="the server on uvloop's event loop")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--layers", default="engine,service,http")
    p.add_argument("--profile", default="", help="py-spy one more HTTP burst into this file")
    p.add_argument("--json", default="")
    p.add_argument("--src", default="", help="the server's source tree (default: this one's)")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve:
        serve_main(a)
        return 0
    import httpx
    from bench_procs import free_port, make_env

    layers = a.layers.split(",")
    ideal = a.n / ((a.step_ms + a.python_ms) / 1000)
    print(
        f"# N={a.n}, {a.tokens} tokens, step {a.step_ms} + {a.python_ms} ms: ideal {ideal:.0f} "
        f"tok/s; prefill {a.prefill_ms} ms a wave, +{a.new_shape_ms} ms a new wave size; "
        f"gather {a.gather_ms} ms"
    )
    service, _ = build(a) if {"engine", "service"} & set(layers) else (None, None)
    port = free_port()
    child = None
    if "http" in layers:
        argv = ["--tokenizer", a.tokenizer, "--n", str(a.n), "--step-ms", str(a.step_ms),
                "--python-ms", str(a.python_ms), "--prefill-ms", str(a.prefill_ms),
                "--new-shape-ms", str(a.new_shape_ms), "--gather-ms", str(a.gather_ms),
                "--switch-ms", str(a.switch_ms), *(["--http", a.http] if a.http else []),
                *(["--uvloop"] if a.uvloop else []),
                "--serve", "--port", str(port)]  # fmt: skip
        env = make_env(False)
        if a.src:  # another build's server (run this script with it on PYTHONPATH too)
            env["PYTHONPATH"] = a.src
        child = subprocess.Popen(
            [sys.executable, __file__, *argv],
            env=env,
            stdout=subprocess.DEVNULL,
        )
        wait_ready(port, child)
    rows: dict[str, list[dict[str, Any]]] = defaultdict(list)
    try:
        for rep in range(a.reps + 1):  # the first is a warm-up
            for layer in layers[rep % len(layers) :] + layers[: rep % len(layers)]:
                if layer == "http":
                    assert child is not None
                    cpu0 = cpu_seconds(child.pid)
                    r = asyncio.run(http_burst(port, rep, a.n, a.tokens))
                    r["cpu_us_per_token"] = (cpu_seconds(child.pid) - cpu0) * 1e6 / r["tokens"]
                    r["waves"] = httpx.get(f"http://127.0.0.1:{port}/bench/waves").json()
                else:
                    burst = engine_burst if layer == "engine" else service_burst
                    service.engine._runner.waves = []
                    cpu0 = cpu_seconds()
                    r = asyncio.run(burst(service, rep, a.n, a.tokens))
                    r["cpu_us_per_token"] = (cpu_seconds() - cpu0) * 1e6 / r["tokens"]
                    r["waves"] = service.engine._runner.waves
                row = {"layer": layer, "rep": rep, **{k: rnd(v) for k, v in r.items()}}
                print(json.dumps(row), flush=True)
                if rep:
                    rows[layer].append(row)
                    if a.json:
                        with open(a.json, "a") as f:
                            f.write(json.dumps({**row, "step_ms": a.step_ms, "n": a.n}) + "\n")
        if a.profile and child is not None:
            spy = str(Path(sys.executable).parent / "py-spy")
            rec = subprocess.Popen(
                [
                    spy,
                    "record",
                    "--pid",
                    str(child.pid),
                    "--rate",
                    "500",
                    "--threads",
                    "--idle",
                    "--format",
                    "raw",
                    "--output",
                    a.profile,
                    "--nonblocking",
                ],  # fmt: skip
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(1.0)
            r = asyncio.run(http_burst(port, a.reps + 1, a.n, a.tokens))
            rec.send_signal(2)
            rec.wait(60)
            print(json.dumps({"profiled_http": r}))
            print_profile(a.profile)
    finally:
        if child is not None:
            child.terminate()
            child.wait(30)
        if service is not None:
            service.engine.shutdown()
    base = (
        statistics.median(r["aggregate_tok_s"] for r in rows["engine"]) if rows.get("engine") else 0
    )
    print(
        f"\n{'layer':8} {'aggregate tok/s (min-max)':>28} {'decode tok/s':>13} {'vs engine':>10}"
        f" {'CPU us/token':>13}"
    )
    for layer, rs in rows.items():
        agg = [r["aggregate_tok_s"] for r in rs]
        if not agg:
            continue
        md = statistics.median(agg)
        dec = statistics.median(r["decode_tok_s"] for r in rs)
        ratio = f"{md / base:.2f}" if base else "-"
        cpu = statistics.median(r["cpu_us_per_token"] for r in rs)
        print(
            f"{layer:8} {md:>10.0f} ({min(agg):.0f}-{max(agg):.0f}) {dec:>13.0f} {ratio:>10}"
            f" {cpu:>13.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
