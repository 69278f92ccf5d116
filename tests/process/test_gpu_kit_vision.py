"""The GPU kit's vision run on the CPU: ``make_random_vlm.py`` builds the tiny preset (a
Qwen2.5-VL whose language model is 4-bit, with the processor's files) and its text twin,
which loads as a plain mlx-lm model with the same network; ``bench_vision.py`` times the
first uses, runs every scenario against this server for a couple of tokens and writes the
JSON lines the summary reads."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.demo  # the kit's tokenizer is the demo model's

REPO = Path(__file__).resolve().parents[2]
KIT = REPO / "bench" / "gpu"
TOK = REPO / "models" / "smollm2-135m-instruct"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(port: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited while starting"
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError("the server did not start")


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    if not (TOK / "tokenizer.json").is_file():
        pytest.skip("no demo tokenizer (run mlx-server-demo)")
    root = tmp_path_factory.mktemp("vlm")
    vlm, twin = root / "vlm", root / "text"
    cmd = [sys.executable, str(KIT / "make_random_vlm.py"), str(vlm), "tiny-qwen25vl", "4"]
    subprocess.run([*cmd, str(TOK), "--text", str(twin)], check=True, timeout=300)
    return vlm, twin


def test_the_vlm_and_its_text_twin_are_the_same_language_model(models):
    import mlx.core as mx

    from mlx_server.models.loader import load_model
    from mlx_server.models.vlm_repairs import qwen25_repaired

    vlm, twin = (load_model(str(p)) for p in models)
    assert vlm.capabilities == ["vision"] and type(vlm.processor).__name__ == "Qwen2_5_VLProcessor"
    assert vlm.config["quantization"]["bits"] == 4 and twin.config["model_type"] == "qwen2"
    assert twin.capabilities == []
    assert qwen25_repaired()  # the loader repaired mlx-vlm's window boundaries (vlm_repairs)
    ids = mx.array([[1, 2, 3, 4, 5]])
    ours = vlm.model.language_model(ids)
    ours = getattr(ours, "logits", ours)
    assert mx.allclose(ours, twin.model(ids), atol=1e-4).item()
    # The vision tower stays unquantized, as mlx-vlm's loader reads the checkpoint.
    assert "scales" not in str(vlm.model.vision_tower.parameters().keys())


@pytest.mark.timeout(300)
def test_every_scenario_writes_its_line(models, tmp_path):
    vlm, _ = models
    port = _port()
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "mlx_server", "-m", str(vlm), "--port", str(port)]
    server = subprocess.Popen(
        [*cmd, "--model-id", "m"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    out = tmp_path / "results.jsonl"
    try:
        _wait_ready(port, server)
        bench = [sys.executable, str(KIT / "bench_vision.py"), "--base-url"]
        bench += [f"http://127.0.0.1:{port}/v1", "--model", "m", "--max-tokens", "2"]
        bench += ["--session-max-tokens", "2", "--concurrency", "2", "--repeats", "1"]
        bench += ["--size", "56", "--warmup", "1", "--out", str(out)]
        ran = subprocess.run(bench, timeout=180, env=env, capture_output=True, text=True)
        assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-4000:]
    finally:
        server.terminate()
        server.wait(timeout=30)
    lines = {x["scenario"]: x for x in map(json.loads, out.read_text().splitlines())}
    assert set(lines) == {"first_use", "single", "concurrent", "session", "text"}
    first = lines["first_use"]  # timed before the scenarios, each first use on its own
    assert first["streams"] == 2 and first["probe_s"] > 0
    assert all(
        first[k] > 0 for k in ("text_ttft_s", "text2_ttft_s", "image_ttft_s", "batch_ttft_s")
    )
    assert all(x["errors"] == 0 and x["server"] == "ours" for x in lines.values())
    assert lines["single"]["runs"][0]["completion_tokens"] == 2
    assert lines["concurrent"]["streams"] == 2 and lines["concurrent"]["completion_tokens"] == 4
    turns = lines["session"]["turns"]
    assert len(turns) == 3 and turns[0]["prompt_tokens"] < turns[1]["prompt_tokens"]
    assert lines["session"]["turn2_cached_frac"] > 0.5  # turn 1 (its image too) from the cache
    assert lines["text"]["runs"][0]["completion_tokens"] == 2

    summary = [sys.executable, str(KIT / "bench_vision.py"), "--summary", str(out)]
    printed = subprocess.run(summary, check=True, timeout=60, capture_output=True, text=True)
    frac = lines["session"]["turn2_cached_frac"]
    assert "ours: turn 2 cached fraction" in printed.stdout and str(frac) in printed.stdout
