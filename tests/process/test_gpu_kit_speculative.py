"""The GPU kit's speculative-decoding run on the CPU, on the tiny test model standing in for
the demo model: ``prepare_demo.sh`` splits it into the three carried folders,
``park_demo.sh`` gathers them as each GPU run would, and ``speculative.sh`` joins the parts,
checks them and runs ``bench/speculative.py`` (two streams, with and without
speculation, the Predicted Outputs ceiling), writing its JSON lines, log and verify trace
under ``$OUT``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_model import build_tiny_model

REPO = Path(__file__).resolve().parents[2]
KIT = REPO / "bench" / "gpu"


def run(script: Path, cwd: Path, env: dict[str, str]) -> str:
    proc = subprocess.run(
        ["bash", str(script)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
    )
    assert proc.returncode == 0, (
        f"{script.name} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    return proc.stdout


@pytest.fixture(scope="module")
def parked(tmp_path_factory) -> Path:
    """The tiny model split as prepare_demo.sh carries it, then parked as the GPU runs do."""
    root = tmp_path_factory.mktemp("kit")
    model = build_tiny_model(root / "tiny")
    here = root / "dev"
    here.mkdir()
    run(KIT / "prepare_demo.sh", here, {"DEMO": str(model)})
    for part in ("d1", "d2", "d3"):
        assert (here / ".gpu" / part).is_dir()
    assert (here / ".gpu" / "d1" / "config.json").is_file()
    park = root / "park"
    run(KIT / "park_demo.sh", here, {"PARK": str(park)})
    assert (park / "model.sha256").is_file() and list(park.glob("d.part.*"))
    return park


@pytest.mark.timeout(720)  # the kit's scripts, given up to 600 s
def test_the_run_joins_the_parts_and_writes_every_row(parked, tmp_path):
    out = tmp_path / "out"
    env = {
        "PARK": str(parked),
        "MODELS_DIR": str(tmp_path / "models"),
        "MODELS": "demo",
        "DTYPE": "float32",
        "TOKENS": "12",
        "KS": "2",
        "STREAMS": "2",
        "WORKLOADS": "code,predicted",  # prose runs the code edit's path
        "LEVELS": "2",  # the batch; one stream runs the same script's path
        "PYTHON": sys.executable,
        "S": str(tmp_path / "no-site"),
        "OUT": str(out),
    }
    log = run(KIT / "speculative.sh", REPO, env)
    assert "model.safetensors: OK" in log  # the joined parts match the model's checksum
    assert "plan: " in log and "verify cost / plain step" in log  # the plan's decisions
    assert "!!" not in log  # the run did not die
    lines = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {line["model"] for line in lines} == {"demo float32"}
    rows = {(line.get("workload"), line.get("streams"), line["run"]) for line in lines}
    assert ("code", 2, "prompt lookup k=2") in rows
    assert ("code", 2, "random drafts k=2") in rows
    assert ("predicted", 2, "predicted outputs k=2") in rows
    assert {line["streams"] for line in lines if line["run"] == "step cost"} == {1, 2}
    assert all(line["ratio"] > 0 for line in lines if "ratio" in line)
    assert (out / "speculative.txt").read_text().strip()
    assert "verify batch=" in (out / "trace-demo-float32.log").read_text()
