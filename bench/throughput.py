"""Throughput: our server against mlx_lm.server and the raw engine, side by side in one run.

Starts our server (``python -m mlx_server``) and ``python -m mlx_lm.server`` on the same demo
model, plus the raw engine (``mlx_lm.stream_generate`` in its own process, no HTTP), and runs,
alternating between them to spread the noise of a shared machine:

1. single stream: TTFT and decode tok/s (raw, ours, mlx_lm);
2. N = 1, 2, 4, 8 concurrent streams: aggregate tok/s, p50/p95 TTFT (ours, mlx_lm);
3. a multi-turn chat whose history grows past 1,000 tokens: TTFT per turn, warm (prefix
   cached) against cold (the same history behind a different first token);
4. /health latency while 8 streams run;
4b. fairness: a short request's TTFT while two long prompts prefill, against idle;
5. the Linux-CPU levers: 4-bit against float32 weights, with and without OpenBLAS preloaded
   (single stream, raw and ours).

Prints one JSON line per measurement, then a summary table. Peak RSS per process is recorded.

    .venv/bin/python bench/throughput.py                 # everything (~15-30 min on 2 cores)
    .venv/bin/python bench/throughput.py --quick         # fewer tokens and repetitions
    .venv/bin/python bench/throughput.py --only levers   # one part: single, batch, chat, health, levers
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from bench_procs import HealthProbe, RawWorker, Server, openblas_path, stream_chat

ROOT = Path(__file__).resolve().parents[1]
Q4 = str(ROOT / "models/smollm2-135m-instruct")
F32 = str(ROOT / "models/smollm2-135m-instruct-f32")
TOPICS = [
    "a lighthouse keeper", "a robot that paints", "a lost dog in Paris", "a chess prodigy",
    "a baker on Mars", "a dragon who fears fire", "an old sailor", "a time-travelling cat",
    "a library at night", "a mountain village", "a clockmaker", "a jazz musician",
]  # fmt: skip
RESULTS: list[dict[str, Any]] = []


def emit(**row: Any) -> None:
    row = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


def story(i: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"Write a long, detailed story about {TOPICS[i % 12]}."}]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def med(rows: list[dict[str, Any]], key: str) -> float:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else float("nan")


# ---- scenarios ----------------------------------------------------------------------------


def single(systems: dict[str, Any], label: str, reps: int, max_tokens: int) -> None:
    """One stream at a time; the systems take turns on the same prompt."""
    for rep in range(reps):
        msgs = story(rep)
        for name, system in systems.items():
            if isinstance(system, RawWorker):
                r = system.run(msgs, max_tokens)
            else:
                r = stream_chat(system.base, msgs, max_tokens)
            emit(
                scenario="single", config=label, system=name, rep=rep, ttft_s=r["ttft"],
                decode_tps=r["decode_tps"], tokens=r["tokens"], prompt_tokens=r["prompt_tokens"],
            )  # fmt: skip


def concurrent(base: str, n: int, max_tokens: int, offset: int) -> dict[str, Any]:
    """N streams started together; aggregate tokens per second over the wall time."""
    results: list[dict[str, Any]] = [{}] * n
    barrier = threading.Barrier(n)

    def one(i: int) -> None:
        barrier.wait()
        results[i] = stream_chat(base, story(offset + i), max_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t0 = min(r["t_send"] for r in results)
    t1 = max(r["t_last"] for r in results)
    ttfts = [r["ttft"] for r in results]
    return {
        "aggregate_tps": sum(r["tokens"] for r in results) / (t1 - t0),
        "ttft_p50_s": pct(ttfts, 50),
        "ttft_p95_s": pct(ttfts, 95),
        "tokens": sum(r["tokens"] for r in results),
    }


def batch(servers: dict[str, Server], label: str, reps: int, max_tokens: int, ns: list[int]):
    for rep in range(reps):
        for n in ns:
            for name, srv in servers.items():
                r = concurrent(srv.base, n, max_tokens, offset=rep * 8 + n)
                emit(scenario="batch", config=label, system=name, rep=rep, streams=n, **r)


LOREM = (
    "Here is more background for you to keep in mind. The village sits in a valley between "
    "two rivers; its people grow apples, keep bees, and trade honey for salt with the town "
    "downstream. Every autumn they hold a market where travellers bring news, songs and "
    "tools. The mayor keeps a ledger of every trade, and the children learn to read from it. "
)


def chat(servers: dict[str, Server], label: str, reps: int, turns: int, max_tokens: int) -> None:
    """A conversation growing past 1,000 tokens. Warm: the real history, whose prefix the
    server cached on the previous turn. Cold: the same history with a different first
    token, so nothing is reused. The servers take turns, each with its own history."""
    for rep in range(reps):
        system = f"You are storyteller number {rep}."
        history = {name: [{"role": "system", "content": system}] for name in servers}
        for turn in range(turns):
            for name, srv in servers.items():
                msgs = history[name]
                msgs.append({"role": "user", "content": f"Turn {turn}. {LOREM * 2} What next?"})
                warm = stream_chat(srv.base, msgs, max_tokens)
                nonce = [{"role": "system", "content": f"[{time.time_ns()}] {system}"}]
                cold = stream_chat(srv.base, nonce + msgs[1:], max_tokens)
                emit(
                    scenario="chat", config=label, system=name, rep=rep, turn=turn,
                    prompt_tokens=warm["prompt_tokens"], cached_tokens=warm["cached_tokens"],
                    warm_ttft_s=warm["ttft"], cold_ttft_s=cold["ttft"],
                    warm_over_cold=warm["ttft"] / cold["ttft"] if cold["ttft"] else None,
                )  # fmt: skip
                msgs.append({"role": "assistant", "content": warm["text"]})


def health(servers: dict[str, Server], label: str, max_tokens: int) -> None:
    for name, srv in servers.items():
        with HealthProbe(srv.base) as probe:
            r = concurrent(srv.base, 8, max_tokens, offset=5)
        lat = [x * 1000 for x in probe.latencies]
        emit(
            scenario="health", config=label, system=name, samples=len(lat),
            p50_ms=pct(lat, 50), p95_ms=pct(lat, 95), p99_ms=pct(lat, 99), max_ms=max(lat),
            aggregate_tps=r["aggregate_tps"],
        )  # fmt: skip


def fair(servers: dict[str, Server], label: str, reps: int) -> None:
    """A short request arriving while two long prompts (~2,900 tokens each) prefill: its
    TTFT against the same short request on an idle server, and the long ones' TTFT."""
    short = [{"role": "user", "content": "Say hello."}]
    for rep in range(reps):
        for name, srv in servers.items():
            idle = stream_chat(srv.base, short, 8)["ttft"]
            longs: list[dict[str, Any]] = []

            def long_one(i: int, base: str = srv.base, out: list = longs) -> None:
                msgs = [{"role": "user", "content": f"[{time.time_ns()} {i}] {LOREM * 40}"}]
                out.append(stream_chat(base, msgs, 8))

            threads = [threading.Thread(target=long_one, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            time.sleep(0.5)  # both long prompts are in and prefilling
            busy = stream_chat(srv.base, short, 8)
            for t in threads:
                t.join()
            emit(
                scenario="fair", config=label, system=name, rep=rep, short_idle_ttft_s=idle,
                short_busy_ttft_s=busy["ttft"], busy_over_idle=busy["ttft"] / idle,
                long_ttft_s=max(r["ttft"] for r in longs),
                short_done_before_longs=busy["t_last"] < min(r["t_first"] for r in longs),
            )  # fmt: skip


def levers(reps: int, max_tokens: int) -> None:
    """4-bit vs float32 weights, with and without OpenBLAS: single stream, raw and ours."""
    configs = [("q4", Q4, False), ("f32", F32, False), ("q4+openblas", Q4, True)]
    configs.append(("f32+openblas", F32, True))
    for label, model, blas in configs:
        if blas and not openblas_path():
            print(f"# skipping {label}: OpenBLAS is not installed")
            continue
        with running(f"lever {label}", model, blas, mlx_lm=False) as (systems, _):
            single(systems, f"lever {label}", reps, max_tokens)


class running:
    """Start raw worker + our server (+ mlx_lm.server) for one configuration; record RSS."""

    launcher = ""  # --ours-launcher

    def __init__(self, label: str, model: str, blas: bool, mlx_lm: bool = True):
        self.label, self.model, self.blas, self.mlx_lm = label, model, blas, mlx_lm
        self.systems: dict[str, Any] = {}

    def __enter__(self) -> tuple[dict[str, Any], dict[str, Server]]:
        self.systems["raw"] = RawWorker(self.model, self.blas)
        self.systems["ours"] = Server("ours", self.model, self.blas, launcher=self.launcher).start()
        if self.mlx_lm:
            self.systems["mlx_lm"] = Server("mlx_lm", self.model, self.blas).start()
        servers = {k: v for k, v in self.systems.items() if isinstance(v, Server)}
        warm_up = [{"role": "user", "content": "Say hello."}]
        for name, system in self.systems.items():  # first-call costs stay out of the figures
            if name == "raw":
                system.run(warm_up, 8)
            else:
                stream_chat(system.base, warm_up, 8)
        for server in servers.values():  # and the idle-time warm-up is over
            server.settle()
        return self.systems, servers

    def __exit__(self, *exc: Any) -> None:
        for name, s in self.systems.items():
            emit(scenario="memory", config=self.label, system=name, peak_rss_mb=s.peak_rss_mb())
            s.stop()


# ---- summary --------------------------------------------------------------------------------


def rows(**match: Any) -> list[dict[str, Any]]:
    return [r for r in RESULTS if all(r.get(k) == v for k, v in match.items())]


def summary(main: str) -> None:
    print("\n## Summary (medians over repetitions)\n")
    print("| measure | raw engine | ours | mlx_lm.server | target |")
    print("|---|---|---|---|---|")

    def line(measure: str, vals: dict[str, float | None], target: str = "") -> None:
        cells = [
            f"{vals[k]:.2f}" if vals.get(k) is not None else "-" for k in ("raw", "ours", "mlx_lm")
        ]
        print(f"| {measure} | {' | '.join(cells)} | {target} |")

    for cfg in sorted({r["config"] for r in rows(scenario="single")}):
        tps = {
            s: med(rows(scenario="single", config=cfg, system=s), "decode_tps")
            for s in ("raw", "ours", "mlx_lm")
        }
        ttft = {
            s: med(rows(scenario="single", config=cfg, system=s), "ttft_s")
            for s in ("raw", "ours", "mlx_lm")
        }
        ratio = tps["ours"] / tps["raw"] if tps.get("raw") else float("nan")
        line(f"{cfg}: single-stream decode tok/s", tps, f"ours/raw = {ratio:.2f} (target >= 0.98)")
        line(f"{cfg}: single-stream TTFT s", ttft)
    one = med(rows(scenario="batch", config=main, system="ours", streams=1), "aggregate_tps")
    for n in sorted({r["streams"] for r in rows(scenario="batch")}):
        agg = {
            s: med(rows(scenario="batch", config=main, streams=n, system=s), "aggregate_tps")
            for s in ("ours", "mlx_lm")
        }
        p50 = {
            s: med(rows(scenario="batch", config=main, streams=n, system=s), "ttft_p50_s")
            for s in ("ours", "mlx_lm")
        }
        p95 = {
            s: med(rows(scenario="batch", config=main, streams=n, system=s), "ttft_p95_s")
            for s in ("ours", "mlx_lm")
        }
        target = ""
        if n == 8:
            target = f"ours = {agg['ours'] / one:.2f}x our 1-stream (>= 3); {agg['ours'] / agg['mlx_lm']:.2f}x mlx_lm (>= 1.3)"
        line(f"{main}: {n} streams aggregate tok/s", agg, target)
        line(
            f"{main}: {n} streams TTFT p50 / p95 s",
            {k: p50[k] for k in p50},
            "p95: " + ", ".join(f"{k} {v:.2f}" for k, v in p95.items()),
        )
    for turn in sorted({r["turn"] for r in rows(scenario="chat")}):
        by = {s: rows(scenario="chat", turn=turn, system=s) for s in ("ours", "mlx_lm")}
        warm = {s: med(v, "warm_ttft_s") for s, v in by.items()}
        cold = {s: med(v, "cold_ttft_s") for s, v in by.items()}
        ratio = {s: med(v, "warm_over_cold") for s, v in by.items()}
        first = by["ours"][0] if by["ours"] else by["mlx_lm"][0]
        line(
            f"chat turn {turn} ({first['prompt_tokens']} tok, {first['cached_tokens']} cached): warm TTFT s",
            warm,
            "cold "
            + ", ".join(f"{k} {v:.2f}" for k, v in cold.items())
            + "; warm/cold "
            + ", ".join(f"{k} {v:.2f}" for k, v in ratio.items())
            + " (target <= 0.2 at >= 1000 cached)",
        )
    for cfg in sorted({r["config"] for r in rows(scenario="health")}):
        by = {r["system"]: r for r in rows(scenario="health", config=cfg)}
        line(
            f"{cfg}: /health p50 ms under 8 streams",
            {k: v["p50_ms"] for k, v in by.items()},
            "p99 "
            + ", ".join(f"{k} {v['p99_ms']:.1f}" for k, v in by.items())
            + " ms (target < 50)",
        )
    for cfg in sorted({r["config"] for r in rows(scenario="fair")}):
        fair_rows = rows(scenario="fair", config=cfg)
        systems = sorted({r["system"] for r in fair_rows})
        line(
            f"{cfg}: short request TTFT s while 2 long prompts prefill",
            {
                k: med([r for r in fair_rows if r["system"] == k], "short_busy_ttft_s")
                for k in systems
            },
            "idle "
            + ", ".join(
                f"{k} {med([r for r in fair_rows if r['system'] == k], 'short_idle_ttft_s'):.2f}"
                for k in systems
            )
            + "; long TTFT "
            + ", ".join(
                f"{k} {med([r for r in fair_rows if r['system'] == k], 'long_ttft_s'):.2f}"
                for k in systems
            ),
        )
    for cfg in sorted({r["config"] for r in rows(scenario="memory")}):
        rss = {r["system"]: r["peak_rss_mb"] for r in rows(scenario="memory", config=cfg)}
        line(f"{cfg}: peak RSS MB", rss)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="32 tokens, 1 repetition, 4 chat turns")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--turns", type=int, default=8, help="chat turns (history passes 1,000 tokens)")
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument(
        "--config",
        default="f32+openblas",
        help="main configuration: q4, f32, q4+openblas, f32+openblas",
    )
    ap.add_argument(
        "--only", default="", help="comma list of: single,batch,chat,health,fair,levers"
    )
    ap.add_argument("--json", default="", help="also write all rows to this file")
    ap.add_argument(
        "--ours-launcher", default="", help="run this Python file instead of -m mlx_server"
    )
    args = ap.parse_args()
    running.launcher = args.ours_launcher
    if args.quick:
        args.max_tokens, args.reps, args.turns = 32, 1, 7
    parts = (
        set(args.only.split(","))
        if args.only
        else {"single", "batch", "chat", "health", "fair", "levers"}
    )
    ns = [int(x) for x in args.streams.split(",")]
    model = F32 if args.config.startswith("f32") else Q4
    blas = args.config.endswith("openblas") and openblas_path() is not None
    print(f"# main configuration {args.config} ({model}, OpenBLAS {'on' if blas else 'off'})")
    if parts & {"single", "batch", "chat", "health", "fair"}:
        with running(args.config, model, blas) as (systems, servers):
            if "single" in parts:
                single(systems, args.config, args.reps, args.max_tokens)
            if "batch" in parts:
                batch(servers, args.config, args.reps, args.max_tokens, ns)
            if "chat" in parts:
                chat(servers, args.config, args.reps, args.turns, 16)
            if "health" in parts:
                health(servers, args.config, args.max_tokens)
            if "fair" in parts:
                fair(servers, args.config, args.reps)
    if "levers" in parts:
        levers(args.reps, max(16, args.max_tokens // 2))
    summary(args.config)
    if args.json:
        Path(args.json).write_text("\n".join(json.dumps(r) for r in RESULTS) + "\n")


if __name__ == "__main__":
    main()
