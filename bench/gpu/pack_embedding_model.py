"""Copy an embedding model for the GPU kit, its float weights stored in float16.

    python3 pack_embedding_model.py SRC DEST

A run may carry 64 MiB: all-MiniLM-L6-v2's float32 weights are 91 MB, 45 MB in float16.
Every other file of the model (tokenizer, config, sentence-transformers modules) is copied
as it is. The benchmark loads the weights in the dtype it is asked for, on both sides.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file


def pack(src: Path, dest: Path) -> Path:
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(
        src,
        dest,
        ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.onnx", "onnx", "openvino"),
    )
    for path in src.rglob("*.safetensors"):
        weights = load_file(str(path))
        half = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in weights.items()}
        target = dest / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        save_file(half, str(target), metadata={"format": "pt"})
    return dest


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print(pack(Path(sys.argv[1]), Path(sys.argv[2])))
