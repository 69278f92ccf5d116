"""Start N mlx-server replicas on this machine behind HAProxy (deploy/haproxy/haproxy.cfg).

    .venv/bin/python deploy/replicas.py -n 2 --port 8080 -- -m models/smollm2-135m-instruct

Everything after ``--`` is given to every replica (``mlx-server`` flags; each replica gets
its own ``--port`` and listens on 127.0.0.1). The balancer listens on ``--host:--port``
and sends each conversation back to the replica that holds its prefix cache (see the
config's comments). Stop everything with Ctrl-C. ``--print-config`` prints the config this
would run and exits, for copying to a machine of its own.

Needs only the standard library and the ``haproxy`` binary (``apt-get install haproxy``,
``brew install haproxy``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

CONFIG = Path(__file__).resolve().parent / "haproxy" / "haproxy.cfg"
BEGIN, END = "    # replicas: begin\n", "    # replicas: end\n"
NAME = "[replicas]"
WILDCARD = ("0.0.0.0", "::")
PUMPS: list[threading.Thread] = []  # copy the children's output until they end


def render(
    template: str, bind: str, replicas: Sequence[str], check_interval: str | None = None
) -> str:
    """The config for ``replicas`` (``host:port`` each, named r1, r2, ... in order) behind
    ``bind`` (``host:port``)."""
    head, rest = template.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    servers = "".join(f"    server r{i} {a} id {i}\n" for i, a in enumerate(replicas, 1))
    text = head + BEGIN + servers + END + tail
    text, n = re.subn(r"(?m)^(frontend mlx\n    bind )\S+", rf"\g<1>{bind}", text)
    if n != 1:
        raise ValueError("the config has no 'bind' line first in 'frontend mlx'")
    if check_interval is not None:
        text, n = re.subn(r"(?m)^(    default-server .*inter )\S+", rf"\g<1>{check_interval}", text)
        if n != 1:
            raise ValueError("the config has no 'default-server ... inter' line")
    return text


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    argv = list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    server_args = argv[cut + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("-n", "--replicas", type=int, default=2, help="how many replicas (2)")
    p.add_argument("--host", default="127.0.0.1", help="the balancer's address (127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="the balancer's port (8080)")
    p.add_argument(
        "--replica-ports",
        help="comma-separated ports of the replicas (default: the ports after --port)",
    )
    p.add_argument("--check-interval", help="time between health checks (the config's: 2s)")
    p.add_argument(
        "--gpu-per-replica",
        action="store_true",
        help="give replica i only GPU i (CUDA_VISIBLE_DEVICES=i), on a machine of several GPUs",
    )
    p.add_argument("--ready-timeout", type=float, default=900, help="seconds to load (900)")
    p.add_argument("--print-config", action="store_true", help="print the config and exit")
    args = p.parse_args(argv[:cut])
    if any(a == "--port" or a.startswith("--port=") for a in server_args):
        p.error("each replica's --port is chosen here (--replica-ports)")
    if args.replica_ports:
        args.ports = [int(x) for x in args.replica_ports.split(",")]
        args.replicas = len(args.ports)
    else:
        args.ports = [args.port + i for i in range(1, args.replicas + 1)]
    return args, server_args


def pump(name: str, proc: subprocess.Popen[str]) -> None:
    """Copy a child's output to ours, each line marked with the child's name."""
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(f"[{name}] {line}")
        sys.stdout.flush()


def start(name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    thread = threading.Thread(target=pump, args=(name, proc), daemon=True)
    thread.start()
    PUMPS.append(thread)
    print(f"{NAME} {name}: pid {proc.pid}", flush=True)
    return proc


def with_allowed_host(server_args: list[str], host: str) -> list[str]:
    """The replicas see the Host header that clients send the balancer: a balancer on an
    address of its own needs that address among the replicas' ``--allowed-hosts``."""
    if host in ("127.0.0.1", "localhost", "::1", *WILDCARD):
        if host in WILDCARD:
            print(
                f"{NAME} note: with --host {host}, give the replicas the names and addresses "
                "clients use for this machine (after --: --allowed-hosts NAME,ADDRESS)",
                flush=True,
            )
        return server_args
    args = list(server_args)
    for i, a in enumerate(args):
        if a == "--allowed-hosts" and i + 1 < len(args):
            args[i + 1] = f"{args[i + 1]},{host}"
            return args
        if a.startswith("--allowed-hosts="):
            args[i] = f"{a},{host}"
            return args
    return [*args, "--allowed-hosts", host]


def own_cache_dirs(server_args: list[str], names: list[str]) -> dict[str, list[str]]:
    """Each replica's arguments with a prefix-cache disk tier of its own (``DIR/r1``, ...):
    a disk tier belongs to one process (each keeps its own manifest and deletes the files it
    does not list). ``--prompt-cache-dir ''`` (no disk tier) is left as it is."""
    args, root = list(server_args), None
    for i, a in enumerate(args):
        if a == "--prompt-cache-dir" and i + 1 < len(args):
            root = args[i + 1]
            del args[i : i + 2]
            break
        if a.startswith("--prompt-cache-dir="):
            root = a.split("=", 1)[1]
            del args[i]
            break
    if root == "":
        return {n: [*args, "--prompt-cache-dir", ""] for n in names}
    if root is None:
        from mlx_server.engine.cache.disk import default_root  # honours its variable

        root = str(default_root())
    return {n: [*args, "--prompt-cache-dir", str(Path(root) / n)] for n in names}


def start_replicas(
    args: argparse.Namespace, server_args: list[str], procs: dict[str, subprocess.Popen[str]]
) -> None:
    """Start the replicas, each into ``procs`` as soon as it runs (to be stopped later)."""
    names = [f"r{i}" for i in range(1, len(args.ports) + 1)]
    per_replica = own_cache_dirs(with_allowed_host(server_args, args.host), names)
    for i, (name, port) in enumerate(zip(names, args.ports, strict=True)):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if args.gpu_per_replica:
            env["CUDA_VISIBLE_DEVICES"] = str(i)
        cmd = [sys.executable, "-m", "mlx_server", *per_replica[name]]
        cmd += ["--host", "127.0.0.1", "--port", str(port)]
        procs[name] = start(name, cmd, env)


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def wait_healthy(urls: list[str], procs: dict[str, subprocess.Popen[str]], timeout: float) -> bool:
    """Whether every URL answered 200 before ``timeout``, and no process died meanwhile."""
    deadline = time.monotonic() + timeout
    pending = list(urls)
    while pending and time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs.values()):
            return False
        pending = [u for u in pending if not healthy(u)]
        if pending:
            time.sleep(0.25)
    return not pending


def supervise(procs: dict[str, subprocess.Popen[str]]) -> int:
    """Run until the balancer exits or a signal arrives; report replicas that die (the
    balancer moves their conversations to the others)."""
    reported: set[str] = set()
    while procs["haproxy"].poll() is None:
        for name, p in procs.items():
            if name not in reported and p.poll() is not None:
                reported.add(name)
                print(f"{NAME} {name} exited ({p.returncode})", flush=True)
        time.sleep(0.25)
    return int(procs["haproxy"].returncode)


def stop(procs: dict[str, subprocess.Popen[str]]) -> None:
    for p in procs.values():
        if p.poll() is None:
            p.terminate()
    for p in procs.values():
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for t in PUMPS:
        t.join(5)  # their last lines (shutdown messages) are printed


def find_haproxy() -> str | None:
    """The ``haproxy`` binary: on the PATH, or where packages put it (/usr/sbin is not on
    every user's PATH)."""
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin"])
    return shutil.which("haproxy", path=path)


def main(argv: Sequence[str] | None = None) -> int:
    args, server_args = parse_args(sys.argv[1:] if argv is None else argv)
    backends = [f"127.0.0.1:{p}" for p in args.ports]
    config = render(CONFIG.read_text(), f"{args.host}:{args.port}", backends, args.check_interval)
    if args.print_config:
        sys.stdout.write(config)
        return 0
    haproxy = find_haproxy()
    if haproxy is None:
        print(f"{NAME} haproxy not found (apt-get install haproxy)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="mlx-server-replicas-"))
    (work / "haproxy.cfg").write_text(config)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # runs the finally below
    procs: dict[str, subprocess.Popen[str]] = {}
    try:
        start_replicas(args, server_args, procs)
        urls = [f"http://{b}/health" for b in backends]
        if not wait_healthy(urls, procs, args.ready_timeout):
            print(f"{NAME} the replicas did not all start", file=sys.stderr)
            return 1
        procs["haproxy"] = start("haproxy", [haproxy, "-db", "-f", str(work / "haproxy.cfg")])
        host = "127.0.0.1" if args.host in WILDCARD else args.host
        if not wait_healthy([f"http://{host}:{args.port}/health"], procs, 30):
            print(f"{NAME} the balancer did not start", file=sys.stderr)
            return 1
        print(f"{NAME} ready: http://{args.host}:{args.port} -> {', '.join(backends)}", flush=True)
        return supervise(procs)
    except KeyboardInterrupt:
        return 130
    finally:
        stop(procs)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
