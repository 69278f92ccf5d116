"""Which carried wheels a machine needs: prints the paths of those to install, one a line.

    python3 site_wheels.py WHEEL_DIR [--site /tmp/site] [--pinned "mlx-embeddings mlx-vlm"]

A wheel is needed when its distribution is not installed (in this interpreter's packages or
in ``--site``, where earlier runs installed theirs), or when it is one of ``--pinned`` (the
project relies on that exact version) and the installed version differs. Everything else
the machine has is kept: its own torch stack (transformers, tokenizers, sentence-transformers
...) is what sentence-transformers is measured with.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name(path: Path) -> tuple[str, str]:
    """(distribution, version) from a wheel's file name (PEP 427)."""
    dist, ver = path.name.split("-")[:2]
    return canonical(dist), ver


def installed(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def needed(wheels: list[Path], pinned: set[str]) -> list[Path]:
    out = []
    for path in wheels:
        dist, ver = wheel_name(path)
        have = installed(dist)
        if have is None or (dist in pinned and have != ver):
            out.append(path)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("wheels", type=Path)
    parser.add_argument("--site", type=Path, default=Path("/tmp/site"))
    parser.add_argument("--pinned", default="mlx-embeddings mlx-vlm")
    args = parser.parse_args()
    sys.path.insert(0, str(args.site))  # importlib.metadata reads sys.path's dist-info
    pinned = {canonical(p) for p in args.pinned.split()}
    for path in needed(sorted(args.wheels.glob("*.whl")), pinned):
        print(path)


if __name__ == "__main__":
    main()
