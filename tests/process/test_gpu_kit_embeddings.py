"""The GPU kit's embeddings run (bench/gpu/embeddings.sh and its helpers) end to end on the
CPU, on a tiny random-weight model in the embedding demo model's layout, so that a typo or a
changed interface cannot break it before a GPU run: the model packed with float16 weights,
the carried wheels the machine lacks installed offline and those it has left alone, the
benchmark's JSON lines written for every workload."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pytest
from embedding_support import build_tiny_bert_embedder
from safetensors.numpy import load_file

pytestmark = pytest.mark.demo

REPO = Path(__file__).resolve().parents[2]
KIT = REPO / "bench" / "gpu"
PROBE = "mlx_server_kit_probe"


def make_wheel(folder: Path, dist: str, ver: str, module: str | None = None) -> Path:
    """A minimal pure-Python wheel (PEP 427), its RECORD hashed, so pip installs it offline."""
    files = {
        f"{dist}-{ver}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {ver}\n"
    }
    files[f"{dist}-{ver}.dist-info/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    if module:
        files[f"{module}/__init__.py"] = "PROBE = True\n"
    record = []
    for name, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{name},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{dist}-{ver}.dist-info/RECORD,,")
    files[f"{dist}-{ver}.dist-info/RECORD"] = "\n".join(record) + "\n"
    path = folder / f"{dist}-{ver}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def run_script(script: str, *args: str, env: dict[str, str], timeout: float = 600) -> str:
    proc = subprocess.run(
        [*script.split(), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def carried(tmp_path_factory) -> Path:
    """A .gpu/e as prepare_embeddings.sh lays it out, built offline: the packed model and
    two wheels, one the machine lacks and one it has at the carried version."""
    root = tmp_path_factory.mktemp("kit")
    model = build_tiny_bert_embedder(root / "tiny-bert")
    e = root / "e"
    run_script(
        sys.executable, str(KIT / "pack_embedding_model.py"), str(model), str(e / "model"), env={}
    )
    (e / "wheels").mkdir()
    make_wheel(e / "wheels", PROBE, "0.1", module=PROBE)
    make_wheel(e / "wheels", "numpy", version("numpy"))
    return e


def test_the_model_is_packed_in_float16(carried):
    weights = load_file(str(carried / "model" / "model.safetensors"))
    assert {v.dtype for v in weights.values() if v.dtype.kind == "f"} == {np.dtype("float16")}
    for name in ("tokenizer.json", "vocab.txt", "modules.json", "1_Pooling/config.json"):
        assert (carried / "model" / name).is_file(), name


def test_only_missing_or_pinned_wheels_are_installed(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, PROBE, "0.1", module=PROBE)  # not installed
    make_wheel(wheels, "numpy", version("numpy"))  # installed, this version
    make_wheel(wheels, "tokenizers", "0.0.1")  # installed, another version: kept
    make_wheel(wheels, "mlx_embeddings", "0.0.1")  # pinned, another version: replaced
    site = str(tmp_path / "site")
    out = run_script(
        sys.executable, str(KIT / "site_wheels.py"), str(wheels), "--site", site, env={}
    )
    names = sorted(Path(line).name.split("-")[0] for line in out.split())
    assert names == ["mlx_embeddings", PROBE]


def test_the_run_installs_what_lacks_and_writes_every_workload(carried, tmp_path):
    site, out = tmp_path / "site", tmp_path / "out"
    env = {
        "E": str(carried),
        "S": str(site),
        "OUT": str(out),
        "PYTHON": sys.executable,
        "SRC": str(REPO / "src"),
        "TORCH_DEVICE": "cpu",
        "DTYPES": "float32",
        "REPEATS": "1",
        "WORKLOADS": "1 short,16 short,256 short,32 long",
        "LABEL": "cpu-smoke",
        "BENCH_TIMEOUT": "900",
    }
    log = run_script("bash " + str(KIT / "embeddings.sh"), env=env)
    assert (site / PROBE / "__init__.py").is_file(), log  # installed offline
    assert not (site / "numpy").exists()  # the machine's own numpy is kept
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["workload"] for r in rows] == [
        "1 short text",
        "16 short texts",
        "256 short texts",
        "32 long texts (≥ 256 tokens)",
    ]
    for r in rows:
        assert r["scenario"] == "embeddings" and r["label"] == "cpu-smoke float32"
        assert r["ours_texts_s"] > 0 and r["st_texts_s"] > 0 and r["min_cos"] > 0.999
        assert r["dtype"] == "float32" and r["torch_device"] == "cpu"
    assert rows[-1]["tokens_per_text"] == 256  # the long texts are cut at the maximum
    assert "32 long texts" in (out / "embeddings.txt").read_text()
