"""Processes and clients for bench/throughput.py: the two HTTP servers, a raw-engine worker
(``mlx_lm.stream_generate`` in its own process, no HTTP), and a streaming chat client."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
OPENBLAS_GLOBS = (
    "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/libopenblas.so.0",
)


def openblas_path() -> str | None:
    """The OpenBLAS library scripts/openblas.sh would preload, if installed."""
    import glob

    for pattern in OPENBLAS_GLOBS:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    return None


def make_env(openblas: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["PYTHONPATH"] = str(ROOT / "src")
    env["PYTHONUNBUFFERED"] = "1"
    lib = openblas_path() if openblas else None
    if lib:
        env["LD_PRELOAD"] = lib
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def peak_rss_mb(pid: int) -> float | None:
    """Peak resident memory of a process (Linux /proc); None where unavailable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


@dataclass
class Server:
    """One HTTP server process: ``ours`` (mlx-server) or ``mlx_lm`` (mlx_lm.server)."""

    kind: str
    model: str
    openblas: bool
    extra: list[str] = field(default_factory=list)
    launcher: str = ""  # a Python file to run instead of ``-m mlx_server`` (a patched build)
    port: int = 0
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 600) -> Server:
        self.port = free_port()
        if self.kind == "ours":
            entry = [self.launcher] if self.launcher else ["-m", "mlx_server"]
            args = [*entry, "-m", self.model, "--port", str(self.port)]
            args += ["--ctx-size", "4096", *self.extra]
        else:
            args = ["-m", "mlx_lm.server", "--model", self.model, "--port", str(self.port)]
            args += self.extra
        self.log_path = Path(f"/tmp/bench-{self.kind}-{self.port}.log")
        log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=make_env(self.openblas),
        )
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.kind} server exited: {self.log_path.read_text()[-2000:]}"
                )
            try:
                if httpx.get(f"{self.base}/v1/models", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.kind} server did not become ready")

    def settle(self, timeout: float = 60) -> float:
        """Wait until the server has nothing left for its idle time (our ``/health``'s
        ``warming_up``; mlx_lm.server: at once), so that no measured request meets a
        warm-up piece; the seconds waited."""
        t0 = time.time()
        while time.time() - t0 < timeout:
            try:
                body = httpx.get(f"{self.base}/health", timeout=5).json()
            except (httpx.HTTPError, ValueError):
                break
            if not (isinstance(body, dict) and body.get("warming_up") is True):
                break
            time.sleep(0.1)
        return time.time() - t0

    def peak_rss_mb(self) -> float | None:
        return peak_rss_mb(self.proc.pid) if self.proc else None

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def stream_chat(
    base: str, messages: list[dict[str, Any]], max_tokens: int, client: httpx.Client | None = None
) -> dict[str, Any]:
    """One streamed chat completion at temperature 0: TTFT, decode rate, tokens, cache hits."""
    body = {
        "model": "default_model",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    own = client is None
    client = client or httpx.Client(timeout=600)
    t0 = time.perf_counter()
    t_first = t_last = 0.0
    chunks, usage, text = 0, None, []
    try:
        with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                usage = data.get("usage") or usage
                for choice in data.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        now = time.perf_counter()
                        t_first = t_first or now
                        t_last = now
                        chunks += 1
                        text.append(piece)
    finally:
        if own:
            client.close()
    n = int(usage["completion_tokens"]) if usage else chunks
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "t_send": t0,
        "t_first": t_first,
        "t_last": t_last,
        "ttft": t_first - t0,
        "tokens": n,
        "decode_tps": (n - 1) / (t_last - t_first) if n > 1 and t_last > t_first else 0.0,
        "prompt_tokens": (usage or {}).get("prompt_tokens", 0),
        "cached_tokens": cached or 0,
        "text": "".join(text),
    }


class HealthProbe:
    """Polls GET /health in a thread and records each answer's latency."""

    def __init__(self, base: str, period: float = 0.02):
        self.base, self.period = base, period
        self.latencies: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                t = time.perf_counter()
                r = client.get(f"{self.base}/health")
                if r.status_code == 200:
                    self.latencies.append(time.perf_counter() - t)
                self._stop.wait(self.period)


class RawWorker:
    """``mlx_lm.stream_generate`` in a child process with the same environment as a server."""

    def __init__(self, model: str, openblas: bool):
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__)), model],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=make_env(openblas),
        )
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline()
        if not ready.startswith("ready"):
            raise RuntimeError(f"raw worker failed to start: {ready!r}")

    def run(self, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"messages": messages, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def peak_rss_mb(self) -> float | None:
        return peak_rss_mb(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(30)


def _raw_worker_main(model_dir: str) -> None:
    """Read JSON requests on stdin; answer with the raw engine's timings on stdout."""
    from mlx_lm import load, stream_generate

    model, tokenizer = load(model_dir)[:2]
    print("ready", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        prompt = tokenizer.apply_chat_template(req["messages"], add_generation_prompt=True)
        t0 = time.perf_counter()
        t_first = t_last = 0.0
        n, text, last = 0, [], None
        for last in stream_generate(model, tokenizer, prompt, max_tokens=req["max_tokens"]):
            now = time.perf_counter()
            t_first = t_first or now
            t_last = now
            n += 1
            text.append(last.text)
        out = {
            "ttft": t_first - t0,
            "tokens": n,
            "decode_tps": (n - 1) / (t_last - t_first) if n > 1 else 0.0,
            "prompt_tokens": len(prompt),
            "mlx_generation_tps": last.generation_tps if last else 0.0,
            "text": "".join(text),
        }
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    _raw_worker_main(sys.argv[1])
