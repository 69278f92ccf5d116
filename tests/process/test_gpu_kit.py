"""Every script of the GPU kit (bench/gpu/) runs end to end on the tiny model on the CPU, so a
change to the engine's events, the server's API or a script cannot break the kit unnoticed
before a GPU run. Few tokens, small prompts: this checks that the scripts work, not speed."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import free_port, launch

# The kit's scripts run as processes of their own, each given up to 240 s.
pytestmark = [pytest.mark.tiny, pytest.mark.timeout(900)]

KIT = Path(__file__).resolve().parents[2] / "bench" / "gpu"


def kit(script: str, *args: str, timeout: float = 240) -> str:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, str(KIT / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def results(tiny_model_dir: Path, tmp_path_factory) -> Path:
    """Run the whole kit once: raw engine, layers, then the server's scenarios."""
    out = tmp_path_factory.mktemp("kit") / "results.jsonl"
    m = str(tiny_model_dir)
    kit("raw_engine.py", "--model", m, "--label", "raw tiny", "--max-tokens", "4",
        "--repeats", "1", "--prefill-repeats", "1", "--system-tokens", "50", "--ignore-eos",
        "--out", str(out))  # fmt: skip
    kit("layers.py", "--model", m, "--label", "layers tiny", "--levels", "1,2",
        "--max-tokens", "4", "--single-tokens", "4", "--system-tokens", "50", "--rounds", "2",
        "--out", str(out))  # fmt: skip
    port = free_port()
    srv = launch(["-m", m, "--port", str(port), "--model-id", "m", "--ctx-size", "4096",
                  "--prompt-cache-dir", ""])  # fmt: skip
    try:
        assert srv.wait_ready(120), "\n".join(srv.lines[-20:])
        url = f"http://127.0.0.1:{port}/v1"
        kit("bench_openai.py", "--base-url", url, "--model", "m", "--label", "ours tiny",
            "--scenario", "burst,single,concurrency,prefix,nonstream,long_ctx,constrained",
            "--concurrency", "1,2", "--burst-n", "2", "--max-tokens", "4", "--repeats", "1",
            "--conc-max-tokens", "4", "--turns", "2", "--prefix-max-tokens", "2",
            "--system-tokens", "50", "--long-system-tokens", "50", "--long-max-tokens", "2",
            "--nonstream-repeats", "1", "--constrained-rounds", "2",
            "--server-pid", str(srv.proc.pid),
            "--out", str(out))  # fmt: skip
        kit("bench_openai.py", "--base-url", url, "--model", "m", "--label", "ours logprobs",
            "--scenario", "concurrency", "--concurrency", "2", "--conc-max-tokens", "4",
            "--conc-extra", '{"logprobs": true, "top_logprobs": 2}', "--out", str(out))  # fmt: skip
        kit("variants.py", "--model", m, "--base-url", url, "--label", "variants tiny",
            "--max-tokens", "4", "--repeats", "2", "--out", str(out))  # fmt: skip
    finally:
        srv.stop()
    return out


def test_every_script_writes_its_lines(results):
    out = results
    got = rows(out)
    kinds = {(r["scenario"], r.get("layer"), r.get("what")) for r in got}
    for want in [
        ("raw_engine", None, None),
        ("layer", "stream_generate", None),
        ("layer", "batch_generator", None),
        ("layer", "engine", None),
        ("layer", "engine", "prefill"),
        ("layer", "stream_generate", "shapes"),
        ("burst", None, None),
        ("single", None, None),
        ("concurrency", None, None),
        ("prefix", None, None),
        ("long_ctx", None, None),
        ("constrained", None, None),
        ("variants", None, None),
    ]:
        assert want in kinds, f"no {want} line"
    engine = [r for r in got if r.get("layer") == "engine" and r.get("n")]
    assert engine and all(r["tokens"] >= r["n"] for r in engine)  # usage read from Finished


def test_the_new_scenarios_report_what_they_promise(results):
    out = results
    got = rows(out)
    (single,) = [r for r in got if r["scenario"] == "single"]
    assert single["idle_warm_up_wait_s"] >= 0  # measured once the idle-time work was done
    (long_ctx,) = [r for r in got if r["scenario"] == "long_ctx"]
    assert [t["turn"] for t in long_ctx["turns"]] == [1, 2, 3]
    assert long_ctx["turns"][2]["cached_tokens"] > long_ctx["turns"][0]["prompt_tokens"] // 2
    (cons,) = [r for r in got if r["scenario"] == "constrained"]
    assert [x["n"] for x in cons["levels"]] == [1, 2]
    assert all(x["json_schema"]["aggregate_tok_s"] > 0 for x in cons["levels"])
    assert cons["warm_up"] is True  # the grammar compiler is built before the measured runs
    for level in cons["levels"]:  # each N in interleaved rounds
        assert level["rounds"] == 2 and len(level["free"]["aggregate_tok_s_all"]) == 2
        q = level["ratio_per_round"]
        assert len(q["all"]) == 2 and q["min"] <= q["median"] == level["ratio"] <= q["max"]
    variants = {r["variant"]: r for r in got if r["scenario"] == "variants"}
    assert set(variants) == {"greedy", "temp0.7_top_p0.95", "logprobs5", "ignore_eos", "stop"}
    for row in variants.values():  # each round turns the order: no variant is always last
        positions = [x["position"] for x in row["rounds"]]
        assert len(positions) == 2 and positions[0] != positions[1], row["variant"]
        assert len(row["ours_tokens"]) == len(row["raw_tokens"]) == 2
    eos = variants["ignore_eos"]  # both sides run to max_tokens
    assert eos["raw_tokens"] == eos["ours_tokens"] == [4, 4]
    stream = [r for r in got if r.get("layer") == "stream_generate" and "what" not in r]
    assert {r["ignore_eos"] for r in stream} == {False, True}


def test_a_concurrency_run_sends_its_extra_fields(results):
    """``--conc-extra`` (the kit's ``LOGPROBS=1``): the bursts again with log-probabilities
    asked, labelled apart, every stream answered."""
    (run,) = [r for r in rows(results) if r["scenario"] == "concurrency" and r.get("extra")]
    assert run["extra"] == {"logprobs": True, "top_logprobs": 2} and run["label"] == "ours logprobs"
    (level,) = run["levels"]
    assert level["n"] == 2 and level["failed"] == 0 and level["total_completion_tokens"] == 8


def test_the_server_cpu_per_token_is_reported(results):
    """``--server-pid``: the server's CPU per 1,000 tokens, for one stream and each level."""
    got = rows(results)
    (single,) = [r for r in got if r["scenario"] == "single"]
    (conc,) = [r for r in got if r["scenario"] == "concurrency" and not r.get("extra")]
    for value in [
        single["server_cpu_s_per_1k_tok"],
        *(x["server_cpu_s_per_1k_tok"] for x in conc["levels"]),
    ]:
        assert value is not None and value > 0
    # Each level's prefill as the server timed it (its final chunk's timings), to tell a
    # burst's one prefill wave from several.
    for x in conc["levels"]:
        assert (
            0 < x["server_prompt_ms_min"] <= x["server_prompt_ms_p50"] <= x["server_prompt_ms_max"]
        )


def test_a_process_cpu_time_is_read_with_or_without_proc():
    sys.path.insert(0, str(KIT))
    try:
        from bench_openai import parse_ps_time, process_cpu_clock, process_cpu_s
    finally:
        sys.path.remove(str(KIT))
    assert parse_ps_time("00:01:02\n") == 62  # Linux ps
    assert parse_ps_time("1:02.50") == 62.5  # macOS ps
    assert parse_ps_time("2-01:00:00") == 2 * 86400 + 3600
    own = process_cpu_s(os.getpid())
    assert own is not None and own > 0
    # On Linux the process's CPU-time clock, to the nanosecond (clock ticks of 10 ms made a
    # short span's CPU read 0): here it reads what this process's own clock reads.
    if sys.platform.startswith("linux"):
        assert process_cpu_clock(os.getpid()) is not None
        before = time.process_time()
        read = process_cpu_s(os.getpid())
        after = time.process_time()
        assert read is not None and before <= read <= after


def test_the_summary_reads_every_line(results):
    out = results
    text = kit("summary.py", str(out))
    for word in (
        "raw_engine",
        "long_ctx",
        "constrained",
        "variant greedy",
        "ratios",
        "new chunk lengths",
        "server CPU",
    ):
        assert word in text


def test_the_attention_shapes_script_writes_every_mode(tmp_path):
    out = tmp_path / "short_attention.jsonl"
    kit("short_attention.py", "--offsets", "2", "--dims", "64", "--batches", "1",
        "--lengths", "9", "--padded-lengths", "128", "--keys", "300",
        "--out", str(out))  # fmt: skip
    got = {(r["mode"], r["impl"]): r for r in rows(out)}
    assert set(got) == {
        ("short", "fused"),
        ("short", "plain"),
        ("padded", "fused"),
        ("padded", "padded"),
        ("decode", "fused"),
        ("decode", "copied"),
    }
    assert got["decode", "fused"]["length"] == 1 and got["padded", "padded"]["length"] == 128
    assert all(r["round1_median_ms"] > 0 and r["round2_max_ms"] > 0 for r in got.values())


def test_the_dispatch_probe_writes_each_kind_and_mode(tmp_path):
    out = tmp_path / "dispatch.jsonl"
    kit("pass_dispatch.py", "--shape", "tiny", "--passes", "3", "--out", str(out))
    got = {(r["width"], r["mode"]): r for r in rows(out)}
    assert set(got) == {(w, m) for w in (1, 9) for m in ("alone", "queued")}
    phases = ("build_ms", "dispatch_ms", "wait_ms")
    assert all(r["step_ms"] > 0 and all(r[p] >= 0 for p in phases) for r in got.values())
    settings = {k: v for k, v in os.environ.items() if k.startswith("MLX_")}  # as it ran
    assert all(r["shape"] == "tiny" and r["env"] == settings for r in got.values())


def test_padded_keys_give_the_exact_attention():
    sys.path.insert(0, str(KIT))
    try:
        import mlx.core as mx
        import short_attention
    finally:
        sys.path.remove(str(KIT))
    q = mx.random.normal((1, 32, 128, 64))
    k, v = mx.random.normal((1, 8, 430, 64)), mx.random.normal((1, 8, 430, 64))
    exact = short_attention.FUSED(q, k, v, scale=0.125, mask="causal")
    padded = short_attention.padded(q, k, v, scale=0.125)
    assert mx.allclose(exact, padded, atol=1e-5).item()


def test_random_models_are_made(tiny_model_dir, tmp_path):
    kit("make_random_model.py", str(tmp_path / "m"), "tiny", "4", str(tiny_model_dir))
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and (tmp_path / "m" / "tokenizer.json").exists()


# The GPU kit's real-shape presets, checked from their shapes alone (nothing is computed): the
# parameter count with SmolLM2's 49,152-token vocabulary in place of the model's own, and the kind
# of cache each layer keeps (hybrid: gated-delta state plus KV; sliding window plus full).
REAL_SHAPES = {
    "qwen35-9b": (7_322_219_008, {"ArraysCache": 24, "KVCache": 8}),
    "gptoss-20b": (20_039_605_824, {"KVCache": 12, "RotatingKVCache": 12}),
}

# Their scaled-down twins, built and run on the CPU through the same code path.
TWINS = {
    "tiny-qwen35": {"ArraysCache": 3, "KVCache": 1},
    "tiny-gptoss": {"KVCache": 2, "RotatingKVCache": 2},
}


@pytest.mark.parametrize("preset", sorted(REAL_SHAPES))
def test_real_shape_presets_have_their_models_layers(preset, tiny_model_dir, tmp_path):
    out = kit("make_random_model.py", str(tmp_path / "m"), preset, "4", str(tiny_model_dir),
              "--count")  # fmt: skip
    facts = json.loads(out.splitlines()[-1])
    assert (facts["parameters"], facts["caches"]) == REAL_SHAPES[preset]
    assert not (tmp_path / "m").exists()  # counting builds nothing


@pytest.mark.parametrize("preset", sorted(TWINS))
def test_the_twins_are_built_4_bit_and_run_in_mlx_lm(preset, tiny_model_dir, tmp_path):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    out = tmp_path / preset
    kit("make_random_model.py", str(out), preset, "4", str(tiny_model_dir))
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 64
    if preset == "tiny-gptoss":  # the model's own rule: its router stays at 8 bits
        assert config["quantization"]["model.layers.0.mlp.router"]["bits"] == 8
    model, tokenizer = load(str(out))
    cache = make_prompt_cache(model)
    kinds: dict[str, int] = {}
    for c in cache:
        kinds[type(c).__name__] = kinds.get(type(c).__name__, 0) + 1
    assert kinds == TWINS[preset]
    ids = tokenizer.encode("The rules of this session follow. " * 8)  # past the tiny window
    logits = model(mx.array([ids]), cache=cache)
    step = model(mx.array([[ids[-1]]]), cache=cache)  # one decode step on the filled caches
    assert logits.shape[-1] == step.shape[-1] == 49152
    assert mx.isfinite(logits).all().item() and mx.isfinite(step).all().item()


def test_a_variant_the_model_ends_at_once_is_a_run_without_a_rate():
    """A random-weight model may sample an end of sequence first where EOS is not banned
    (temperature, greedy): that run has no rate, and the kit goes on; a stream cut short or
    an error still fails it."""
    sys.path.insert(0, str(KIT))
    try:
        import variants
    finally:
        sys.path.remove(str(KIT))
    assert variants.ended_at_once({"ok": False, "finish_reason": "stop"})
    assert not variants.ended_at_once({"ok": False, "finish_reason": None})
    assert not variants.ended_at_once({"ok": False, "finish_reason": "stop", "server_error": "x"})
    row = variants.variant_row(
        argparse.Namespace(label="t", max_tokens=4),
        "greedy",
        [
            (0, {"decode_tok_s": 10.0, "tokens": 4, "ttft_s": 0.1},
             {"decode_tok_s": None, "completion_tokens": 0, "ttft_s": None}),
            (1, {"decode_tok_s": 10.0, "tokens": 4, "ttft_s": 0.1},
             {"decode_tok_s": 9.0, "completion_tokens": 4, "ttft_s": 0.2}),
        ],
    )  # fmt: skip
    assert row["ratio_per_round"]["all"] == [0.9] and row["ours_ttft_s"] == 0.2


def test_the_constrained_engine_script_compares_both_masked_orders(tiny_model_dir):
    """``bench/constrained_engine.py`` (the kit's ``CONSTRAINED_ENGINE=1``): every mode runs
    its streams to the token limit, the summary gives each order against free decoding, and
    ``--phases`` says where a step's time went: masked steps only where grammars mask."""
    script = KIT.parent / "constrained_engine.py"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, str(script), "--model", str(tiny_model_dir), "--streams", "2",
         "--modes", "free,batched,launched,eager", "--rounds", "1", "--max-tokens", "6",
         "--phases"],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    runs = [x for x in lines if "mode" in x]
    assert {x["mode"] for x in runs} == {"free", "batched", "launched", "eager"}
    assert all(x["tokens"] == [6, 6] and x["reasons"] == ["length"] for x in runs)
    for x in runs:
        spent = x["phases_ms_per_step"]
        assert spent["decode_step"] > 0 and spent["model"] > 0
        if x["mode"] == "free":
            assert "masked" not in spent and "plan" not in spent
        else:
            assert spent["masked"] > 0 and spent["plan"] > 0 and spent["mask"] > 0
            assert spent["masked"] >= spent["masked_rest"] >= 0
    (summary,) = [x for x in lines if "summary" in x]
    assert summary["batched_over_free"] > 0 and summary["launched_over_free"] > 0
    assert summary["eager_over_free"] > 0


def test_the_disk_evictions_script_compares_the_two_tiers(tiny_model_dir, tmp_path):
    """``disk_evictions.py``: with a RAM tier of one entry every finishing stream evicts one;
    the engine with a disk tier hands each to it on its thread (``disk.save``, timed), the
    other drops them; both take the same rounds and the ratio row compares them."""
    out = tmp_path / "disk.jsonl"
    kit("disk_evictions.py", "--model", str(tiny_model_dir), "--levels", "2", "--rounds", "2",
        "--prompt-tokens", "80", "--max-tokens", "4", "--entries", "1", "--min-tokens", "32",
        "--out", str(out))  # fmt: skip
    lines = rows(out)
    by_engine = {x["engine"]: x for x in lines if "engine" in x}
    assert set(by_engine) == {"disk", "ram"}
    for x in by_engine.values():
        assert x["n"] == 2 and len(x["decode_tok_s"]["all"]) == 2
        assert x["prompt_cache_evictions"] == 4  # 2 rounds of 2 streams, each evicting one
        assert min(x["decode_tok_s"]["all"]) > 0  # every answer ran to its 4 tokens
    assert "prompt_cache_disk_entries" not in by_engine["ram"]
    (ratio,) = [x for x in lines if x.get("what") == "ratio"]
    assert ratio["disk_saves"] == 4 and ratio["disk_save_ms_each"] > 0
    assert ratio["prompt_tokens"] >= 32
    assert len(ratio["decode_disk_over_ram_per_round"]["all"]) == 2
    assert len(ratio["aggregate_disk_over_ram_per_round"]["all"]) == 2
    summary = kit("summary.py", str(out))
    assert "disk tier  N=2   decode with / without it per round" in summary
    assert "4 saves" in summary


def test_one_stream_s_fill_beside_the_launch_and_after_it_in_one_run(tiny_model_dir):
    """The next GPU run's first call at one stream: ``batched`` with ``--beside`` reads and
    fills on the masks' worker (the engine thread waits for its result), ``launched`` on the
    engine's thread after the launch (no worker); both run to the limit."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, str(KIT.parent / "constrained_engine.py"), "--model", str(tiny_model_dir),
         "--streams", "1", "--modes", "free,batched,launched", "--rounds", "1", "--max-tokens",
         "6", "--schema", "notes", "--beside", "--phases"],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    runs = {x["mode"]: x for x in lines if "mode" in x}
    assert set(runs) == {"free", "batched", "launched"}
    assert all(x["tokens"] == [6] and x["reasons"] == ["length"] for x in runs.values())
    beside, after = runs["batched"]["phases_ms_per_step"], runs["launched"]["phases_ms_per_step"]
    assert beside["compute"] > 0 and beside["result"] > 0
    assert after["compute"] > 0 and "result" not in after
    (summary,) = [x for x in lines if "summary" in x]
    assert summary["batched_over_free"] > 0 and summary["launched_over_free"] > 0


def test_the_constrained_scripts_run_the_pool_the_notes_schema_and_the_timeline(tiny_model_dir):
    """``constrained_engine.py``'s ``pooled`` mode with ``--schema notes`` runs its streams
    to the limit and, its masks filled on the worker thread, times each hand-off
    (``timeline_ms``: medians and 90th percentiles, in order); ``constrained_fill.py`` prints
    a line per rows, way and busy threads."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, str(KIT.parent / "constrained_engine.py"), "--model", str(tiny_model_dir),
         "--streams", "2", "--modes", "free,pooled", "--rounds", "1", "--max-tokens", "6",
         "--schema", "notes", "--pool-threads", "2", "--phases"],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"streams"')]
    assert {x["mode"] for x in runs} == {"free", "pooled"}
    assert all(x["tokens"] == [6, 6] and x["reasons"] == ["length"] for x in runs)
    (pooled,) = [x for x in runs if x["mode"] == "pooled"]
    timeline = pooled["timeline_ms"]
    assert set(timeline) == {"start", "done", "ask", "back", "late"}
    assert all(0 <= median <= p90 for median, p90 in timeline.values())
    assert timeline["start"][0] <= timeline["done"][0]
    path = {**env, "PYTHONPATH": os.pathsep.join([str(KIT.parent), env.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(KIT.parent / "constrained_fill.py"), "--model", str(tiny_model_dir),
         "--sizes", "1,3", "--threads", "2", "--steps", "4", "--busy", "0,1", "--schema", "notes"],
        capture_output=True, text=True, timeout=240, env=path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    ways = {(x["rows"], x["way"], x["busy_threads"]) for x in lines}
    assert ways == {(n, w, b) for n in (1, 3) for w in ("inline", "pool2") for b in (0, 1)}
    assert all(x["steps"] == 4 and 0 < x["ms_median"] <= x["ms_p90"] for x in lines)


def test_a_context_s_rest_leaves_out_only_what_ran_inside_it():
    """``--phases``' accounting: a context's ``_rest`` is its time less its direct children's
    on its own thread; a phase also timed outside it (the model's prefill) or nested deeper
    (a launch inside the graph) is not taken off twice, so the rest is never negative."""
    sys.path.insert(0, str(KIT.parent))
    try:
        import constrained_engine as ce
    finally:
        sys.path.remove(str(KIT.parent))
    clock = {"t": 0.0}

    def tick(seconds: float):
        def fn() -> None:
            clock["t"] += seconds

        return fn

    real = ce.time.perf_counter
    ce.time.perf_counter = lambda: clock["t"]
    try:
        launch = ce._timed("async_eval", tick(1.0))
        model = ce._timed("model", lambda: (tick(2.0)(), launch()))
        prefill = ce._timed("model", tick(50.0))
        masked = ce._timed("masked", lambda: (model(), tick(4.0)(), launch()))
        ce.phase_ms(1)  # zero the totals
        prefill()
        masked()
        got = ce.phase_ms(1)
    finally:
        ce.time.perf_counter = real
    # masked: 2 + 1 (the graph and its launch) + 4 + 1 (its own launch) = 8 s; its children
    # are the graph (3 s, its launch inside) and its own launch (1 s)
    assert got["masked"] == 8000 and got["masked_rest"] == 4000
    assert got["model"] == 53000 and got["masked async_eval"] == 2000


def test_the_engine_rounds_time_a_stream_whose_text_comes_only_at_the_end():
    """``layers.engine_once``' decode rate runs from the last stream's first token, read
    from the engine's own timings: a stream whose text is held back to its end (a random
    model's unfinished character) once made that window a millisecond (34 million tok/s)."""
    import asyncio

    from mlx_server.engine.core.handle import Started, TokenPiece
    from mlx_server.events import Finished, Timings, Usage

    sys.path.insert(0, str(KIT))
    try:
        import layers
    finally:
        sys.path.remove(str(KIT))
    clock = {"t": 0.0}

    def events(text_at_end: bool):
        async def gen():
            yield Started()
            clock["t"] = 1.0  # both streams' first token
            if not text_at_end:
                yield TokenPiece("a")
            clock["t"] = 5.0
            if text_at_end:
                yield TokenPiece("all of it")
            clock["t"] += 0.001
            yield Finished("length", Usage(10, 9), Timings(10, 1.0, 9, 4000.0))

        return gen()

    class Engine:
        streams = iter([False, True])

        def submit(self, req, loop):
            return events(next(self.streams))

    real = layers.time.perf_counter
    layers.time.perf_counter = lambda: clock["t"]
    try:
        row = asyncio.run(layers.engine_once(Engine(), [[1, 2], [3, 4]], 9, True))
    finally:
        layers.time.perf_counter = real
    # 16 tokens after the two first ones, from the later first token (about 1.0) to the end
    assert row["tokens"] == 18
    assert 3.9 < row["decode_tok_s"] < 4.1


def test_the_kit_s_engine_runs_the_server_s_cuda_paths(tiny_model_dir, monkeypatch):
    """``layers.make_engine`` (the engine rows of ``layers.py`` and ``disk_evictions.py``)
    puts in the short queries' attention the server's loader installs on a CUDA GPU (a CUDA
    GPU simulated here): a warm turn's short chunk then computes plainly, as the server's does,
    not through a cuDNN graph built for its key length."""
    import mlx.core as mx
    from mlx_lm import load

    from mlx_server.models import cuda_attention

    sys.path.insert(0, str(KIT))
    try:
        import layers
    finally:
        sys.path.remove(str(KIT))
    model, tok = load(str(tiny_model_dir))
    monkeypatch.setattr(cuda_attention, "on_cuda_gpu", lambda: True)
    cuda_attention.uninstall()  # MLX's own, whatever ran before in this process
    try:
        assert mx.fast.scaled_dot_product_attention is not cuda_attention.short_query_attention
        engine = layers.make_engine(model, tok, 2)
        assert mx.fast.scaled_dot_product_attention is cuda_attention.short_query_attention
        assert engine is not None
    finally:
        cuda_attention.uninstall()


def test_one_stream_s_phases_are_per_engine_step():
    """At one stream the engine runs the lone runner (no ``gen.next``): the kit's per-step
    phases then divide by the engine's steps, not print the whole run's totals as one step."""
    sys.path.insert(0, str(KIT))
    try:
        import layers
    finally:
        sys.path.remove(str(KIT))
    lone = layers.phase_summary({"engine._step": {"s": 2.0, "cpu_s": 1.0, "n": 100}}, 100)
    assert lone["steps"] == 100 and lone["engine._step"]["ms_per_step"] == 20.0
    batch = {"engine._step": {"s": 2.0, "n": 110}, "gen.next": {"s": 1.5, "n": 100}}
    assert layers.phase_summary(batch, 800)["engine._step"]["ms_per_step"] == 20.0


def test_layers_casts_the_weights_before_the_engine_s_thread_runs(tiny_model_dir, tmp_path):
    """``layers.py --dtype`` with nothing run on the main thread first (``--skip stream``):
    ``make_engine`` computes the model's lazy arrays (the cast) as the server's loader does,
    so the engine's thread runs the first burst instead of failing every request on an
    array of another thread's stream."""
    out = tmp_path / "layers.jsonl"
    kit("layers.py", "--model", str(tiny_model_dir), "--label", "cast", "--levels", "2",
                 "--max-tokens", "4", "--system-tokens", "50", "--rounds", "1", "--dtype",
                 "float16", "--skip", "stream,compile,shapes", "--out", str(out))  # fmt: skip
    (first,) = [r for r in rows(out) if r.get("what") == "first_burst"]
    assert first["tokens"] == 8 * 32 and first["ttft_p95_s"] > 0


def test_the_engine_s_decode_step_is_mlx_lm_s_graph_and_the_eos_ban(tiny_model_dir):
    """``step_graph.py``: one decode step's graph, written before it is computed, has the ops
    of ``BatchGenerator``'s own step and, for rows that ignore EOS, the ban (a bias added):
    nothing more per step for greedy rows (on a GPU a small model's step is bound by
    launching its ops)."""
    out = kit("step_graph.py", "--model", str(tiny_model_dir), "--streams", "3",
              "--max-tokens", "8")  # fmt: skip
    (row,) = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert row["streams"] == 3 and row["batch_generator_ops"] > 50
    assert row["engine_more"] == {"Broadcast": 1, "Add": 1} and row["engine_fewer"] == {}
    assert row["engine_ops"] == row["batch_generator_ops"] + 2
