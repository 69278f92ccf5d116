"""Helpers the test modules share: server processes, in-process servers over the scripted
engine, spec validators, the demo model's location and test-model builders. Test modules
import from here (fixtures live in conftest.py)."""

from __future__ import annotations

import copy
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from scripted_engine import ScriptedEngine
from tiny_model import build_tiny_model

SPECS = Path(__file__).resolve().parents[3] / "shared" / "specs"
LOCAL_SPECS = Path(__file__).parents[1] / "specs"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class InProcessServer:
    base_url: str
    engine: ScriptedEngine
    service: object
    server: object
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True  # type: ignore[attr-defined]
        self.thread.join(5)


def start_in_process(
    tokenizer,
    *,
    api_key: str = "",
    ctx_size: int = 512,
    engine=None,
    app_kw: dict | None = None,
    **service_kw,
) -> InProcessServer:
    from mlx_server.boot.app import create_app
    from mlx_server.server.metrics import Metrics
    from mlx_server.service import ChatService

    metrics = Metrics()  # the scripted engine's generations observed, as a real engine's
    engine = engine or ScriptedEngine(observer=metrics)
    service = ChatService("scripted-model", tokenizer, engine, ctx_size=ctx_size, **service_kw)
    app = create_app(service, api_key=api_key, metrics=metrics, **(app_kw or {}))
    return serve_in_process(app, engine, service)


def serve_in_process(app, engine=None, service=None) -> InProcessServer:
    """Serve ``app`` with uvicorn on a thread of this process, on a socket bound here and
    kept: a port found free and bound again later may be taken meanwhile (a client's
    ephemeral port, another server)."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    assert server.started, "in-process server did not start"
    return InProcessServer(f"http://127.0.0.1:{port}", engine, service, server, thread)


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    lines: list[str] = field(default_factory=list)
    _q: queue.Queue = field(default_factory=queue.Queue)
    _pumping: threading.Thread | None = None
    err_lines: list[str] = field(default_factory=list)
    _draining: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self._q.put(line)
        self._q.put(None)

    def _drain(self) -> None:
        """Read stderr as it comes: a pipe nobody reads fills up and blocks the server."""
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err_lines.append(line.rstrip("\n"))

    def stderr_text(self, timeout: float = 10) -> str:
        """What the server wrote to stderr; once it has exited, all of it."""
        if self.proc.poll() is not None and self._draining is not None:
            self._draining.join(timeout)
        return "\n".join(self.err_lines)

    def wait_ready(self, timeout: float = 120) -> bool:
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                line = self._q.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                return False
            if "http server listening" in line:
                return True
        return False

    def wait_exit(self, timeout: float = 60) -> int:
        """Wait for the process to exit and for everything it printed to be read."""
        code = self.proc.wait(timeout)
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if self._q.get(timeout=0.5) is None:
                    break
            except queue.Empty:
                continue
        return code

    def wait_for_line(self, text: str, since: int = 0, timeout: float = 30) -> str:
        """The first line from ``since`` on that contains ``text`` (waits for it)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            for line in self.lines[since:]:
                if text in line:
                    return line
            time.sleep(0.02)
        raise AssertionError(f"no line with {text!r}: {self.lines[since:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._pumping is not None:
            self._pumping.join(10)  # it reads stdout to its end
        if self._draining is not None:
            self._draining.join(10)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


NO_TORCH = Path(__file__).resolve().parent / "no_torch"


def launch(args: list[str], env: dict[str, str] | None = None) -> ServerProcess:
    """The server as a process of its own, as a user's install runs it: without torch, which
    only the test tools need (``no_torch/sitecustomize.py``)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env["PYTHONUNBUFFERED"] = "1"
    paths = [str(NO_TORCH), *filter(None, full_env.get("PYTHONPATH", "").split(os.pathsep))]
    full_env["PYTHONPATH"] = os.pathsep.join(paths)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_server", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
    )
    port = int(args[args.index("--port") + 1]) if "--port" in args else 8080
    sp = ServerProcess(proc, port)
    sp._pumping = threading.Thread(target=sp._pump, daemon=True)
    sp._pumping.start()
    sp._draining = threading.Thread(target=sp._drain, daemon=True)
    sp._draining.start()
    return sp


@contextmanager
def serving(
    args: list[str], env: dict[str, str] | None = None, timeout: float = 150
) -> Iterator[ServerProcess]:
    """A server process (on a free port unless ``args`` name one) that has printed its
    readiness line, stopped on leaving, also when it never became ready. A port found free
    may be taken before the server binds it (a client's ephemeral port): then another port,
    up to three tries."""
    own_port = "--port" not in args
    for tries_left in (2, 1, 0):
        sp = launch([*args, "--port", str(free_port())] if own_port else args, env)
        ready = sp.wait_ready(timeout)
        if ready or not own_port or not tries_left or not _port_taken(sp):
            break
        sp.stop()
    try:
        assert ready, f"not ready: {sp.lines} {sp.stderr_text()}"
        yield sp
    finally:
        sp.stop()


def _port_taken(sp: ServerProcess) -> bool:
    """Whether the server stopped because its port was taken (False while it runs)."""
    try:
        sp.proc.wait(10)
    except subprocess.TimeoutExpired:
        return False
    text = sp.stderr_text().lower()
    return "address already in use" in text or "errno 98" in text


REPO = Path(__file__).resolve().parents[2]
DEMO_DIR = REPO / "models" / "smollm2-135m-instruct"
DEMO_F32_DIR = REPO / "models" / "smollm2-135m-instruct-f32"


def demo_model_dir(float32: bool = True) -> Path:
    """The demo model (``mlx-server-demo`` puts it in models/); its float32 copy is the fast
    one on CPU. Tests that need it fail loudly when it is missing."""
    d = DEMO_F32_DIR if float32 else DEMO_DIR
    assert (d / "config.json").is_file(), (
        f"demo model missing: run `mlx-server-demo{' --dtype float32' if float32 else ''}`"
    )
    return d


def schema_validator(name: str):
    """A jsonschema validator for one schema of the official spec extracts."""
    import json

    import jsonschema

    for base in (SPECS, LOCAL_SPECS):
        for fname in (
            "openai-chat.schema.json",
            "anthropic-messages.schema.json",
            "openai-completions.schema.json",
        ):
            p = base / fname
            if not p.exists():
                continue
            doc = json.loads(p.read_text())
            schemas = doc["components"]["schemas"]
            if name in schemas:
                root = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
                return jsonschema.Draft202012Validator(root)
    raise KeyError(name)


def anthropic_validator(name: str, optional: tuple[str, ...] = ()):
    """A validator for one schema of the Anthropic extract (``optional``: made not required).

    Loaded from the Anthropic file itself: both extracts define an ``ErrorResponse``.
    """
    import jsonschema

    doc = json.loads((LOCAL_SPECS / "anthropic-messages.schema.json").read_text())
    comps = copy.deepcopy(doc["components"])
    if optional:
        schema = comps["schemas"][name]
        schema["required"] = [r for r in schema["required"] if r not in optional]
    root = {"$ref": f"#/components/schemas/{name}", "components": comps}
    return jsonschema.Draft202012Validator(root)


MESSAGE = anthropic_validator("Message")
STREAM_EVENT = anthropic_validator("MessageStreamEvent")
ERROR = anthropic_validator("ErrorResponse")
COUNT = anthropic_validator("CountMessageTokensResponse")


def check_event(name: str | None, data: dict) -> None:
    assert name == data["type"]
    if name == "ping":
        assert data == {"type": "ping"}
    elif name == "error":
        ERROR.validate(data)
    else:
        STREAM_EVENT.validate(data)


def stream_events(srv, body: dict, path: str = "/v1/messages", **kw) -> list[tuple[str, dict]]:
    """POST a streaming request; every (event name, data) pair, each checked against the spec."""
    events = []
    with httpx.stream(
        "POST", srv.base_url + path, json={**body, "stream": True}, timeout=30, **kw
    ) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in resp.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: ") :])))
                name = None
            elif line.startswith("error: "):  # Jan's failure line, a field SSE clients ignore
                assert json.loads(line[len("error: ") :])["message"], line
            else:
                assert line == "", line
    for name, data in events:
        check_event(name, data)
    return events


def check_stream_order(events: list[tuple[str, dict]]) -> None:
    """message_start, ping, well-nested blocks with consecutive indexes, delta, stop."""
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    open_index, next_index = None, 0
    for name, data in events[2:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == next_index
            open_index, next_index = data["index"], next_index + 1
        elif name in ("content_block_delta", "content_block_stop"):
            assert data["index"] == open_index
            if name == "content_block_stop":
                open_index = None
        else:
            raise AssertionError(f"unexpected event {name} inside the content")
    assert open_index is None


def build_wide_model(path: Path, layers: int = 8) -> Path:
    """The tiny model with 64-wide heads and more layers: real-sized KV rows (quantizable,
    and big enough that an entry takes a moment to write)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    path = build_tiny_model(path)
    config = json.loads((path / "config.json").read_text())
    config.update(
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=layers,
        intermediate_size=256,
    )
    mx.random.seed(2)
    net = llama.Model(llama.ModelArgs.from_dict(config))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(net.parameters())))
    (path / "config.json").write_text(json.dumps(config))
    return path
