"""``mlx-server --ranks N``: start N ranks on this machine with ``mlx.launch`` and wait.

The same as typing ``mlx.launch -n N --backend ring --starting-port P -- python -m
mlx_server ...`` with this command's flags, on free ring ports. A stop signal (SIGTERM,
SIGINT) goes to the launcher; its ranks watch it and shut down (rank 0 gracefully). The
exit status is 0 after a stop that was asked for and 1 when the ranks ended on their own
(a server never should; mlx.launch itself exits 0 either way).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from types import FrameType

from mlx_server.logs import log


def find_launcher() -> str | None:
    """``mlx.launch`` next to this Python (its virtual environment), else on PATH."""
    here = str(Path(sys.executable).parent)
    return shutil.which("mlx.launch", path=here + os.pathsep + os.environ.get("PATH", ""))


def free_ports(n: int, host: str = "127.0.0.1") -> int:
    """The first of ``n`` consecutive free TCP ports (the ring listens on one per rank)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind((host, 0))
            first = int(s.getsockname()[1])
        if first + n > 65535:
            continue
        try:
            for port in range(first, first + n):
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        return first
    raise OSError(f"no {n} consecutive free ports on {host}")


def command(launcher: str, n: int, port: int, argv: list[str]) -> list[str]:
    return [
        launcher,
        "-n",
        str(n),
        "--backend",
        "ring",
        "--starting-port",
        str(port),
        "--",
        sys.executable,
        "-m",
        "mlx_server",
        *argv,
    ]


def spawn(n: int, argv: list[str]) -> int:
    """Run the ranks until they end; see the module docstring."""
    launcher = find_launcher()
    if launcher is None:
        print("Error: --ranks needs mlx.launch (it comes with mlx)", file=sys.stderr)
        return 1
    cmd = command(launcher, n, free_ports(n), argv)
    log(f"Ranks: starting {n} with {' '.join(cmd[:7])}")
    # A pipe that stays open and silent: the launcher polls its stdin (a closed or /dev/null
    # one would be read without end) and hands what it reads to the ranks.
    env = dict(os.environ)
    # The ranks share this machine's cores: without a limit, each rank's BLAS (OpenBLAS on
    # Linux) starts a thread per core and they crowd each other out.
    env.setdefault("OPENBLAS_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env)
    asked = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal asked
        asked = True
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    proc.wait()
    return 0 if asked else 1
