"""Torch kept out of a text model's process (boot/torchless.py): one local text model hides
it; a vision or embedding model, several models, a hub id, ``MLX_SERVER_TORCH=1``, or a
process that has already imported transformers keeps it visible. Each case runs in a fresh
interpreter, as a server start does (hiding torch is for the rest of a process's life)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
# torch is installed where the tests run (sentence-transformers, the embeddings' reference,
# brings it); where it is not, "visible" reads as the same refusal.
TORCH = importlib.util.find_spec("torch") is not None

# Prints the returned line (or None), then what ``import torch`` does afterwards.
PROBE = """
import json, sys
from mlx_server.boot.torchless import keep_torch_out
model, models_dir, env, preload = json.loads(sys.argv[1])
if preload:
    import transformers
line = keep_torch_out(model, models_dir, env)
try:
    import torch
    after = "imported"
except ImportError:
    after = "refused"
print(json.dumps([line, after]))
"""

# The server's own parse: --tool-call-parser's check imports mlx-lm, and with it transformers.
LAUNCH = """
import json, sys
from mlx_server.cli import parse_launch
_, notes = parse_launch(["-m", sys.argv[1], "--port", "0", "--tool-call-parser", "auto"],
                        torchless=sys.argv[2] == "1")
print(json.dumps([notes, "transformers" in sys.modules, sys.modules.get("torch", 0) is None]))
"""


def _run(code: str, *args: str) -> list:
    env = {k: v for k, v in os.environ.items() if k != "MLX_SERVER_TORCH"}
    # this tree's sources; no tests/helpers/no_torch: torch stays importable where installed
    env["PYTHONPATH"] = str(SRC)
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _model(root: Path, name: str, config: dict, *files: str) -> str:
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    for f in files:
        (d / f).write_text("[]")
    return str(d)


def test_one_local_text_model_hides_torch(tmp_path):
    text = _model(tmp_path, "text", {"model_type": "llama"})
    line, after = _run(PROBE, json.dumps([text, None, {}, False]))
    assert line is not None and "MLX_SERVER_TORCH=1" in line
    assert after == "refused"


@pytest.mark.parametrize(
    "case",
    ["vision", "llava_style", "encoder", "several", "models_dir", "hub_id", "env", "imported"],
)
def test_torch_stays_visible(case, tmp_path):
    text = _model(tmp_path, "text", {"model_type": "llama"})
    model, models_dir, env, preload = text, None, {}, False
    if case == "vision":
        model = _model(tmp_path, "vlm", {"model_type": "qwen2_5_vl", "vision_config": {"depth": 1}})
    elif case == "llava_style":
        model = _model(tmp_path, "fastvlm", {"model_type": "llava_qwen2", "mm_vision_tower": "x"})
    elif case == "encoder":
        model = _model(tmp_path, "minilm", {"model_type": "bert"}, "modules.json")
    elif case == "several":
        model = f"{text},{_model(tmp_path, 'other', {'model_type': 'qwen2'})}"
    elif case == "models_dir":
        models_dir = str(tmp_path)
    elif case == "hub_id":
        model = "mlx-community/Llama-3.2-1B-Instruct-4bit"
    elif case == "env":
        env = {"MLX_SERVER_TORCH": "1"}
    elif case == "imported":
        preload = True
    line, after = _run(PROBE, json.dumps([model, models_dir, env, preload]))
    assert line is None
    assert after == ("imported" if TORCH else "refused")


def test_the_server_start_hides_it_before_any_check_imports_mlx_lm(tmp_path):
    text = _model(tmp_path, "text", {"model_type": "llama"})
    notes, transformers, hidden = _run(LAUNCH, text, "1")
    assert any(n.startswith("torch kept out") for n in notes)
    assert transformers and hidden  # the check imported transformers, after the hiding
    notes, transformers, hidden = _run(LAUNCH, text, "0")  # parse_launch for other callers
    assert transformers and not hidden
    assert not any(n.startswith("torch kept out") for n in notes)


HINT = """
import sys
from mlx_server.boot.torchless import with_hint
before = with_hint("No module named 'torch'")
sys.modules["torch"] = None
import json
print(json.dumps([before, with_hint("No module named 'torch'"), with_hint("no config.json")]))
"""


def test_a_load_failure_naming_torch_says_how_to_let_it_in():
    before, hidden, other = _run(HINT)
    assert before == "No module named 'torch'"  # torch not hidden: the message as it was
    assert hidden.endswith("(torch was kept out of this process: MLX_SERVER_TORCH=1 lets it in)")
    assert other == "no config.json"
