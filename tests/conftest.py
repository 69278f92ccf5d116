"""Shared fixtures: a tiny random-weight model, an in-process server over a scripted engine,
and a real ``mlx-server`` process."""

from __future__ import annotations

import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from scripted_engine import ScriptedEngine  # noqa: E402
from tiny_model import build_tiny_model  # noqa: E402

SPECS = Path(__file__).resolve().parents[2] / "shared" / "specs"
LOCAL_SPECS = Path(__file__).parent / "specs"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-model")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return load_tokenizer(tiny_model_dir)


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
    import uvicorn

    from mlx_server.server.app import create_app
    from mlx_server.service import ChatService

    engine = engine or ScriptedEngine()
    service = ChatService("scripted-model", tokenizer, engine, ctx_size=ctx_size, **service_kw)
    app = create_app(service, api_key=api_key, **(app_kw or {}))
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    assert server.started, "in-process server did not start"
    return InProcessServer(f"http://127.0.0.1:{port}", engine, service, server, thread)


@pytest.fixture
def scripted(tiny_tokenizer) -> Iterator[InProcessServer]:
    srv = start_in_process(tiny_tokenizer)
    yield srv
    srv.stop()


@pytest.fixture
def scripted_factory(tiny_tokenizer):
    servers: list[InProcessServer] = []

    def make(**kw) -> InProcessServer:
        srv = start_in_process(tiny_tokenizer, **kw)
        servers.append(srv)
        return srv

    yield make
    for s in servers:
        s.stop()


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    lines: list[str] = field(default_factory=list)
    _q: queue.Queue = field(default_factory=queue.Queue)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            self._q.put(line)
        self._q.put(None)

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

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def launch(args: list[str], env: dict[str, str] | None = None) -> ServerProcess:
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_server", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
    )
    port = int(args[args.index("--port") + 1]) if "--port" in args else 8080
    sp = ServerProcess(proc, port)
    threading.Thread(target=sp._pump, daemon=True).start()
    return sp


@pytest.fixture
def server_factory():
    procs: list[ServerProcess] = []

    def make(
        args: list[str], *, wait: bool = True, env: dict[str, str] | None = None
    ) -> ServerProcess:
        sp = launch(args, env)
        procs.append(sp)
        if wait:
            assert sp.wait_ready(), (
                f"server did not become ready: {sp.lines} {sp.proc.stderr.read() if sp.proc.poll() is not None else ''}"
            )
        return sp

    yield make
    for p in procs:
        p.stop()


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory) -> Iterator[ServerProcess]:
    """One real server process on the tiny model, shared by a module's tests."""
    model = build_tiny_model(tmp_path_factory.mktemp("srv") / "tiny-model")
    port = free_port()
    sp = launch(["-m", str(model), "--port", str(port), "--ctx-size", "256"])
    assert sp.wait_ready(), sp.lines
    yield sp
    sp.stop()


REPO = Path(__file__).resolve().parents[1]
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


@pytest.fixture(scope="module", params=["tiny", pytest.param("demo", marks=pytest.mark.demo)])
def e2e_server(request, tmp_path_factory) -> Iterator[ServerProcess]:
    """A real server process, once on the tiny random model and once on the demo model."""
    if request.param == "tiny":
        model = build_tiny_model(tmp_path_factory.mktemp("srv") / "tiny-model")
    else:
        model = demo_model_dir()
    port = free_port()
    sp = launch(["-m", str(model), "--port", str(port), "--ctx-size", "256"])
    assert sp.wait_ready(300), sp.lines
    yield sp
    sp.stop()


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
