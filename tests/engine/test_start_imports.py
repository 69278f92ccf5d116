"""A text model's start-up imports no heavy package beyond what mlx-lm's own load does.

Each side runs in a fresh interpreter with torch visible where it is installed (unlike the
server processes the tests launch, ``support.launch``): transformers imports torch wherever
it is installed, in ``mlx_lm.server`` too; the server's start keeps it out for a text model
(``boot/torchless.py``). Vision (mlx-vlm) and embedding packages wait for a model that needs
them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# Packages that cost seconds to import, none of which serving a text model needs.
HEAVY = (
    "torch",
    "torchvision",
    "mlx_vlm",
    "mlx_embeddings",
    "sentence_transformers",
    "scipy",
    "sklearn",
    "pandas",
    "cv2",
    "PIL",
)

OURS = """
import json, os, sys
from mlx_server.cli import parse_launch
settings, _ = parse_launch(["-m", sys.argv[1], "--port", "0"], torchless=True)  # as cli.main
from mlx_server.boot.start import build
app, engine = build(settings)
print(json.dumps(sorted(k for k, v in sys.modules.items() if v is not None)), flush=True)
os._exit(0)  # the engine thread is not stopped: only the imports matter here
"""

MLX_LM = """
import json, os, sys
import mlx_lm, mlx_lm.server
mlx_lm.load(sys.argv[1])
print(json.dumps(sorted(k for k, v in sys.modules.items() if v is not None)), flush=True)
os._exit(0)
"""


def _modules(code: str, model: Path) -> set[str]:
    env = dict(os.environ)
    # This tree's sources first; no ``tests/helpers/no_torch``: torch stays importable.
    env["PYTHONPATH"] = os.pathsep.join(
        [
            str(SRC),
            *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and "no_torch" not in p),
        ]
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(model)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def _heavy(modules: set[str]) -> set[str]:
    return {m for m in modules if m.split(".")[0] in HEAVY}


def test_a_text_start_imports_no_heavy_package_beyond_mlx_lm(tiny_model_dir):
    ours = _modules(OURS, tiny_model_dir)
    theirs = _modules(MLX_LM, tiny_model_dir)
    assert "mlx_server.boot.chat" in ours  # the chat start-up ran
    assert not {m for m in ours if m.split(".")[0] in ("mlx_vlm", "mlx_embeddings")}
    assert not {m for m in ours if m.split(".")[0] == "sentence_transformers"}
    beyond = sorted(_heavy(ours) - _heavy(theirs))
    assert not beyond, f"imported at start beyond mlx_lm.load: {beyond[:20]}"
    assert not {m for m in ours if m.split(".")[0] == "torch"}  # kept out (boot/torchless.py)
