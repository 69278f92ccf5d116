"""The GPU kit's linear-attention run (bench/gpu/linear_attention.sh) on the CPU, on a tiny
Qwen3.5: gated_delta.py says there is no CUDA GPU and fails the run's status, verify_shapes.py
still times its decode and verify passes at every new offset and writes its rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from arch_models import build

REPO = Path(__file__).resolve().parents[2]
KIT = REPO / "bench" / "gpu"

pytestmark = [pytest.mark.tiny, pytest.mark.timeout(300)]


def test_the_run_reports_no_gpu_and_times_every_pass(tmp_path: Path) -> None:
    model = build("qwen3_5", tmp_path / "q35")
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHON": sys.executable,
        "OUT": str(out),
        "SRC": str(REPO / "src"),
        "S": str(tmp_path / "site"),  # absent: the venv's MLX is used
        "MODELS": str(model),
        "LENGTHS": "1,5",
        "BATCHES": "1",
        "VBATCHES": "1,2",
        "PASSES": "2",
        "LONG": "40",
    }
    proc = subprocess.run(
        ["bash", str(KIT / "linear_attention.sh")],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=REPO,
        env=env,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1, log  # no CUDA GPU: the kernel part fails, visibly
    assert "no CUDA GPU" in log
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    passes = [r for r in rows if r.get("kind") in ("decode", "verify") and "what" not in r]
    # 2 batches x 2 rounds x 2 passes x (decode, verify), each at a new offset per round.
    assert len(passes) == 16
    for batch in (1, 2):
        offsets = [r["offset"] for r in passes if r["batch"] == batch and r["round"] == 1]
        assert len(set(offsets)) == len(offsets) == 4
    assert {r["tokens"] for r in passes if r["kind"] == "verify"} == {9}
    assert {r["gdn_kernel"] for r in passes} == {False}  # the CPU: mlx-lm's own path
    summaries = {(r["batch"], r["kind"]) for r in rows if r.get("what") == "summary"}
    assert summaries == {(1, "decode"), (1, "verify"), (2, "decode"), (2, "verify")}
    assert [r["tokens"] for r in rows if r.get("kind") == "long_prefill"] == [40]
    assert (out / "linear_attention.txt").is_file()
