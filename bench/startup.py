"""Time from spawn to serving: ours (``python -m mlx_server``) against ``mlx_lm.server`` on the
same model, in interleaved rounds, each server in a fresh process.

Per round and server: ``line_s``, spawn to the server's readiness line (ours: ``http server
listening``, the line Jan's launcher waits for; mlx_lm: ``Starting httpd``, printed before its
model has loaded), and ``answer_s``, spawn to the answer of a one-token chat request sent as
soon as the port accepts a connection (mlx_lm loads its model in its generation thread, so
this is when it can serve). Ours also reports its ``Start:`` phases.

Both run as a user's install does, without torch (transformers imports it wherever it is
installed: ``tests/helpers/no_torch``), unless ``--with-torch``.

    .venv/bin/python bench/startup.py --rounds 5 [--model DIR] [--json out.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

import httpx
from bench_procs import ROOT, free_port, make_env

NO_TORCH = ROOT / "tests" / "helpers" / "no_torch"
READY = {"ours": "http server listening", "mlx_lm": "Starting httpd"}


def command(kind: str, model: str, port: int) -> list[str]:
    if kind != "mlx_lm":
        return [sys.executable, "-m", "mlx_server", "-m", model, "--port", str(port)]
    return [sys.executable, "-m", "mlx_lm", "server", "--model", model, "--port", str(port)]


def cpu_seconds(pid: int) -> float | None:
    """User and system CPU seconds a process has used so far (Linux /proc); None elsewhere.
    Less sensitive than wall time to other work on the machine."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_round(
    kind: str, model: str, openblas: bool, torch: bool, timeout: float, src: str = ""
) -> dict[str, Any]:
    """One start of ``kind`` (``mlx_lm``, or ours: from ``src`` when given, a tree's
    ``src`` folder, else this tree's)."""
    port = free_port()
    env = make_env(openblas)
    if src:
        env["PYTHONPATH"] = src
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # an installed package has its bytecode
    if not torch:
        env["PYTHONPATH"] = f"{NO_TORCH}:{env['PYTHONPATH']}"
    log_path = Path(f"/tmp/bench-startup-{kind}-{port}.log")
    with log_path.open("w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            command(kind, model, port), stdout=log, stderr=subprocess.STDOUT, env=env
        )
    try:
        line_s = answer_s = line_cpu = answer_cpu = None
        deadline = t0 + timeout
        body = {"model": "default_model", "max_tokens": 1, "temperature": 0}
        body["messages"] = [{"role": "user", "content": "Hi"}]
        while time.perf_counter() < deadline and answer_s is None:
            if proc.poll() is not None:
                raise RuntimeError(f"{kind} exited: {log_path.read_text()[-2000:]}")
            text = log_path.read_text()
            if line_s is None and READY["mlx_lm" if kind == "mlx_lm" else "ours"] in text:
                line_s = time.perf_counter() - t0
                line_cpu = cpu_seconds(proc.pid)
            if kind != "mlx_lm" and line_s is None:
                time.sleep(0.02)
                continue
            try:  # mlx_lm answers once its generation thread has loaded the model
                r = httpx.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    json=body,
                    timeout=max(1.0, deadline - time.perf_counter()),
                )
                if r.status_code == 200:
                    answer_s = time.perf_counter() - t0
                    answer_cpu = cpu_seconds(proc.pid)
            except httpx.HTTPError:
                time.sleep(0.02)
        if answer_s is None:
            raise RuntimeError(f"{kind} did not answer within {timeout}s")
        row: dict[str, Any] = {"server": kind}
        if kind != "mlx_lm":  # mlx_lm's line comes before its model loads: not readiness
            row.update(line_s=round(line_s or answer_s, 3), line_cpu_s=line_cpu)
        row.update(answer_s=round(answer_s, 3), answer_cpu_s=answer_cpu)
        for line in log_path.read_text().splitlines():
            if "Start: " in line:
                phases = line.split("Start: ", 1)[1].split(" (")[0].split(", ")
                pairs = [p.rsplit(" ", 1) for p in phases]
                row["phases"] = {name: float(secs.rstrip("s")) for name, secs in pairs}
        return row
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log_path.unlink(missing_ok=True)


def summary(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for kind in dict.fromkeys(r["server"] for r in rows):
        mine = [r for r in rows if r["server"] == kind]
        if not mine:
            continue

        def med(key: str, mine: list[dict[str, Any]] = mine) -> str:
            values = [r[key] for r in mine if r.get(key) is not None]
            return f"{statistics.median(values):.2f}s" if values else "-"

        text = (
            f"{kind} (median of {len(mine)}): readiness line {med('line_s')} "
            f"(CPU {med('line_cpu_s')}), first answer {med('answer_s')} "
            f"(CPU {med('answer_cpu_s')})"
        )
        names = [n for n in (mine[0].get("phases") or {})]
        if names:
            med = {n: statistics.median(r["phases"].get(n, 0.0) for r in mine) for n in names}
            text += "; phases " + ", ".join(f"{n} {v:.2f}s" for n, v in med.items())
        lines.append(text)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "smollm2-135m-instruct"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--servers", default="ours,mlx_lm", help="ours, mlx_lm and --tree labels")
    ap.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="ours from another checkout's src folder (before/after in the same rounds)",
    )
    ap.add_argument("--no-openblas", action="store_true")
    ap.add_argument("--with-torch", action="store_true")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--label", default="", help="recorded in each JSON line (the tree measured)")
    ap.add_argument("--json", help="append one JSON line per round to this file")
    args = ap.parse_args()
    kinds = args.servers.split(",")
    trees = dict(t.split("=", 1) for t in args.tree)
    trees = {label: str(Path(path).resolve() / "src") for label, path in trees.items()}

    def start(kind: str) -> dict[str, Any]:
        return one_round(
            kind,
            args.model,
            not args.no_openblas,
            args.with_torch,
            args.timeout,
            trees.get(kind, ""),
        )

    for kind in kinds:  # unrecorded: bytecode written, files in the page cache
        start(kind)
    rows = []
    for i in range(args.rounds):
        order = kinds if i % 2 == 0 else kinds[::-1]  # alternate which goes first
        for kind in order:
            row = start(kind)
            row.update(round=i + 1, label=args.label, model=Path(args.model).name)
            row["date"] = date.today().isoformat()
            rows.append(row)
            print(json.dumps(row), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
    for line in summary(rows):
        print(line)


if __name__ == "__main__":
    main()
