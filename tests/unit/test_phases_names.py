"""bench/gpu/phases.py times the engine's calls by name on the GPU; every name it wraps
must exist here, so that a rename fails this test rather than the GPU run."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

PHASES = Path(__file__).resolve().parents[2] / "bench" / "gpu" / "phases.py"


def load_phases():
    spec = importlib.util.spec_from_file_location("gpu_phases", PHASES)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_call_phases_wraps_exists():
    phases = load_phases()
    assert len(phases.ENGINE_CALLS) >= 5
    labels = [label for label, *_ in phases.ENGINE_CALLS]
    assert len(set(labels)) == len(labels)
    for label, module, owner, name in phases.ENGINE_CALLS:
        target = importlib.import_module(module)
        if owner:
            assert hasattr(target, owner), (label, module, owner)
            target = getattr(target, owner)
        assert callable(getattr(target, name, None)), (label, module, owner, name)
    handle = importlib.import_module("mlx_server.engine.core.handle")
    assert callable(handle._deliver)
    generate = importlib.import_module("mlx_lm.generate")
    for owner, name in (
        ("BatchGenerator", "next"),
        ("GenerationBatch", "_step"),
        ("PromptProcessingBatch", "prompt"),
        ("PromptProcessingBatch", "generate"),
    ):
        assert callable(getattr(getattr(generate, owner), name, None)), (owner, name)


def test_a_wrapped_call_keeps_its_behaviour_and_is_counted_only_on_the_engine_thread():
    import threading

    phases = load_phases()
    wrapped = phases._timed("t", lambda x: x + 1)
    assert wrapped(1) == 2 and phases.COUNT["t"] == 0  # not the engine's thread
    out: list[int] = []
    thread = threading.Thread(target=lambda: out.append(wrapped(2)), name=phases._ENGINE_THREAD)
    thread.start()
    thread.join(30)
    assert out == [3] and phases.COUNT["t"] == 1
