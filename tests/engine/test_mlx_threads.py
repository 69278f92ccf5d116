"""A thread that ran MLX lives as long as the process: an engine that stops gives its thread
back, the next engine runs on it (on CUDA a thread's end destroys its cuDNN handles, which
synchronizes the device and ends the process when another engine captures a CUDA graph:
``engine/core/mlx_threads.py``)."""

from __future__ import annotations

import threading

import pytest
from clients import wait_until
from engine_runner import drive, generate, load_varied_model, request, running_engine

from mlx_server.engine.core import mlx_threads
from mlx_server.engine.embedding.engine import EmbeddingEngine, EmbeddingEngineConfig

pytestmark = pytest.mark.tiny


def test_engines_one_after_another_run_on_one_thread(tmp_path_factory):
    model, tokenizer, _ = load_varied_model(tmp_path_factory)
    threads = []
    for n in range(3):
        with running_engine(model, tokenizer) as engine:
            assert engine.wait_ready(60)
            result = drive(
                engine, generate(engine, request(list(range(5, 20 + n)), 3, ignore_eos=True))
            )
            assert result.reason == "length"
            threads.append(engine._thread)
        assert engine.ended  # shutdown waited for the loop, not for the thread's end
        assert threads[-1].is_alive()  # parked, its MLX state kept
    assert threads[0] is threads[1] is threads[2]


def test_two_engines_at_once_take_two_threads_and_give_both_back():
    made = mlx_threads.made()
    a = EmbeddingEngine(lambda seqs, types=None: None, EmbeddingEngineConfig())
    b = EmbeddingEngine(lambda seqs, types=None: None, EmbeddingEngineConfig())
    a.start()
    b.start()
    assert a.wait_ready(30) and b.wait_ready(30)
    assert a._thread is not b._thread
    assert a._thread.name == b._thread.name == "mlx-embedding"
    a.shutdown(10)
    b.shutdown(10)
    assert a.ended and b.ended
    assert wait_until(lambda: {a._thread, b._thread} <= set(mlx_threads.parked()), "both parked")
    assert a._thread.is_alive() and b._thread.is_alive()
    assert a._thread.name == "mlx-parked"
    c = EmbeddingEngine(lambda seqs, types=None: None, EmbeddingEngineConfig())
    c.start()
    try:
        assert c.wait_ready(30)
        assert c._thread in (a._thread, b._thread)
        assert mlx_threads.made() <= made + 2
    finally:
        c.shutdown(10)


def test_a_job_that_raises_leaves_its_thread_to_the_next(capfd):
    def boom() -> None:
        raise RuntimeError("the job failed")

    first = mlx_threads.run("mlx-test", boom)
    assert wait_until(lambda: first in mlx_threads.parked(), "it parked")
    assert first.is_alive()
    assert "RuntimeError: the job failed" in capfd.readouterr().err
    ran = threading.Event()
    second = mlx_threads.run("mlx-test", ran.set)
    assert ran.wait(30)
    assert second is first
