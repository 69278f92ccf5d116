"""``mlx-server --ranks N``: N ranks on this machine, started and watched by this process.

What ``mlx.launch -n N --backend ring`` does for one host, set up the way MLX documents it
(its environment variables ``MLX_RANK`` and ``MLX_HOSTFILE``: a JSON list of each rank's
``"ip:port"`` addresses; the ring backend connects them over 127.0.0.1), without that
launcher's polling of the ranks' standard input and with a useful exit status:

- each rank is ``python -m mlx_server`` with this command's flags (``--ranks`` included: a
  rank knows it was launched), on free ports, in a process group of its own, printing to
  this process's stdout and stderr;
- SIGTERM or SIGINT here goes to rank 0, which shuts down and tells the others to stop;
- a rank that ends on its own (a server never should) makes the others end too: they
  notice it themselves within a second and exit with an error; this process ends the
  stragglers after a grace period;
- the exit status is 0 after a stop that was asked for (of this process, or of rank 0 by
  SIGTERM or SIGINT), else a failed rank's (1 when it was killed).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

from mlx_server.engine.core.cpus import usable_cpus
from mlx_server.logs import log

GRACE_S = 10.0  # how long ranks may take to end by themselves before they are killed


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


def hostfile(n: int, first_port: int, host: str = "127.0.0.1") -> str:
    """The ring backend's hostfile for ``n`` ranks on ``host``."""
    return json.dumps([[f"{host}:{first_port + r}"] for r in range(n)])


def rank_env(rank: int, n: int, path: str) -> dict[str, str]:
    env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=path)
    # The ranks share this machine's cores: without a limit, each rank's BLAS (OpenBLAS on
    # Linux) starts a thread per core and they crowd each other out.
    env.setdefault("OPENBLAS_NUM_THREADS", str(max(1, usable_cpus() // n)))
    return env


def spawn(n: int, argv: list[str]) -> int:
    """Run ``n`` ranks until they end; see the module docstring."""
    with tempfile.TemporaryDirectory(prefix="mlx-server-ranks-") as tmp:
        path = str(Path(tmp) / "hosts.json")
        Path(path).write_text(hostfile(n, free_ports(n)))
        cmd = [sys.executable, "-m", "mlx_server", *argv]
        log(f"Ranks: starting {n} on 127.0.0.1 (ring backend)")
        procs = [
            subprocess.Popen(cmd, env=rank_env(r, n, path), start_new_session=True)
            for r in range(n)
        ]
        return _supervise(procs)


def _supervise(procs: list[subprocess.Popen[bytes]]) -> int:
    asked = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal asked
        asked = True
        if procs[0].poll() is None:
            procs[0].send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while all(p.poll() is None for p in procs):
        time.sleep(0.1)
    first = next(p for p in procs if p.returncode is not None)
    if not asked:
        rank = procs.index(first)
        log(f"Ranks: rank {rank} exited with status {first.returncode}; the others stop too")
    _end_all(procs)
    # A stop asked of this process or of rank 0 (SIGTERM, SIGINT: the server's own shutdown).
    if asked or procs[0].returncode in (0, -signal.SIGTERM, -signal.SIGINT):
        return 0
    failed = next((p.returncode for p in procs if p.returncode), 1)
    return failed if failed > 0 else 1


def _end_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """Wait for every rank to end, for a while by itself, then terminated, then killed."""
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(sig)
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
        if all(p.poll() is not None for p in procs):
            return
