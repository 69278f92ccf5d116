"""Where the engine thread's time goes: wrappers that time the step loop's phases.

``install()`` wraps, without changing their behaviour, the calls one engine step is made of:
mlx-lm's ``BatchGenerator.next`` (split into the decode step, the prefill chunks and the time
spent waiting in ``mx.eval`` for the GPU), the engine's per-token work (``delivery.deliver_token``:
detokenizing, stop strings, logprobs, the hand-off to asyncio) and the hand-off itself
(``GenerationHandle.push`` and, once per step, ``Outbox.flush``). ``snapshot()`` returns the
totals (wall seconds, and the engine thread's CPU seconds: wall well above CPU where no
``mx.eval`` waits is time the thread spent blocked, e.g. waiting for the interpreter lock
while the asyncio thread holds it); ``reset()`` zeroes them. Only calls made on the
engine's thread are counted, so the asyncio side does not blur the figures.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from typing import Any

TOTAL: dict[str, float] = defaultdict(float)
CPU: dict[str, float] = defaultdict(float)
COUNT: dict[str, int] = defaultdict(int)
_ENGINE_THREAD = "mlx-engine"


def _timed(name: str, fn: Any, on_engine: bool = True) -> Any:
    """``fn`` with its wall and CPU time added to ``name``'s totals when called on the
    engine's thread (``on_engine=False``: on any thread but the engine's, the asyncio side)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if (threading.current_thread().name == _ENGINE_THREAD) != on_engine:
            return fn(*args, **kwargs)
        t, c = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTAL[name] += time.perf_counter() - t
            CPU[name] += time.thread_time() - c
            COUNT[name] += 1

    wrapper.__wrapped__ = fn
    return wrapper


# The engine's calls timed on its thread: (label, module, class or "" for a module function,
# name). The labels stay those of earlier runs where the call only moved (results compare);
# tests/unit/test_phases_names.py checks every one still exists, so a rename fails a test.
_CORE = "mlx_server.engine.core"
ENGINE_CALLS = [
    ("engine._step", f"{_CORE}.engine", "Engine", "_step"),
    ("engine._admit", f"{_CORE}.engine", "Engine", "_admit"),
    ("engine._start", f"{_CORE}.engine", "Engine", "_start"),
    ("engine._handle_responses", f"{_CORE}.endings", "Endings", "responses"),
    ("engine._drop_cancelled", f"{_CORE}.endings", "Endings", "cancelled"),
    ("engine._finish", f"{_CORE}.endings", "Endings", "finish"),
    ("engine.deliver_token", f"{_CORE}.endings", "", "deliver_token"),
    ("prefixes.keep", f"{_CORE}.prefixes", "Prefixes", "keep"),
    # of it: the trie and the entry's bookkeeping, evictions, the memory budget's check
    ("prefix_cache.insert", "mlx_server.engine.cache.prefix", "PrefixCache", "insert_cache"),
    ("prefix_cache.evict", "mlx_server.engine.cache.prefix", "PrefixCache", "_evict"),
    ("memory.after_insert", f"{_CORE}.memory", "MemoryBudget", "_after_insert"),
    # an evicted entry handed to the disk tier (its arrays cut, their evaluation launched)
    ("disk.save", "mlx_server.engine.cache.disk", "DiskPromptCache", "save"),
    ("engine.flush", f"{_CORE}.handle", "Outbox", "flush"),
    ("handle.push", f"{_CORE}.handle", "GenerationHandle", "push"),
]


def install() -> None:
    import importlib

    import mlx.core as mx

    g = importlib.import_module("mlx_lm.generate")

    from mlx_server.engine.core import handle as h

    g.BatchGenerator.next = _timed("gen.next", g.BatchGenerator.next)
    g.GenerationBatch._step = _timed("gen.decode_step", g.GenerationBatch._step)
    g.PromptProcessingBatch.prompt = _timed("gen.prefill_chunk", g.PromptProcessingBatch.prompt)
    g.PromptProcessingBatch.generate = _timed(
        "gen.prefill_to_decode", g.PromptProcessingBatch.generate
    )
    mx.eval = _timed("mx.eval (GPU wait)", mx.eval)
    mx.async_eval = _timed("mx.async_eval (launch)", mx.async_eval)
    for label, module, owner, name in ENGINE_CALLS:
        target = importlib.import_module(module)
        if owner:
            target = getattr(target, owner)
        setattr(target, name, _timed(label, getattr(target, name)))
    # The asyncio side taking one step's events.
    h._deliver = _timed("loop.deliver", h._deliver, on_engine=False)


def reset() -> None:
    TOTAL.clear()
    CPU.clear()
    COUNT.clear()


def snapshot() -> dict[str, Any]:
    return {
        k: {"s": round(TOTAL[k], 4), "cpu_s": round(CPU[k], 4), "n": COUNT[k]}
        for k in sorted(TOTAL)
    }
