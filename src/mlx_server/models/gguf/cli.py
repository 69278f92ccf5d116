"""`mlx-server-import SRC.gguf DEST_DIR [--dtype float32]`: a GGUF file to an MLX model dir."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .importer import GGUFImportError, import_gguf
from .weights import FLOAT_DTYPES


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlx-server-import",
        description="Import a GGUF model (llama, qwen2, qwen3) into an MLX model directory.",
    )
    parser.add_argument("src", type=Path, help="the .gguf file")
    parser.add_argument("dest", type=Path, help="the model directory to write")
    parser.add_argument(
        "--dtype",
        choices=sorted(FLOAT_DTYPES),
        help="dequantize to this float dtype (default: keep Q4_0/Q4_1/Q8_0 tensors quantized); "
        "float32 is the fastest on a CPU",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the import; print the error and return 1 when the file cannot be imported."""
    args = _parser().parse_args(argv)
    try:
        dest = import_gguf(args.src, args.dest, dtype=args.dtype, progress=not args.quiet)
    except (GGUFImportError, OSError) as exc:
        print(f"mlx-server-import: error: {exc}", file=sys.stderr)
        return 1
    print(dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
