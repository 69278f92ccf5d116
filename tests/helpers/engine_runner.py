"""Drive the real Engine from Python on the tiny model: submit, collect, compare."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mlx_server.engine.cache.disk import DiskPromptCache
from mlx_server.engine.core.engine import Engine, EngineConfig
from mlx_server.engine.core.handle import GenerationHandle, Started, TokenPiece
from mlx_server.engine.runners.assembly import text_runner
from mlx_server.events import Finished, LogprobEntry
from mlx_server.types import GenerationRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0)
T = TypeVar("T")


def text_engine(
    model: Any, tokenizer: Any, config: EngineConfig | None = None, speculation: Any = None
) -> Engine:
    """An Engine with the runner start-up would hand it (speculative when ``speculation``,
    a ``speculative.runner.Speculation``, is given)."""
    config = config or EngineConfig()
    if speculation is None:
        runner = text_runner(model, tokenizer, config)
    else:
        from mlx_server.engine.speculative.assembly import speculative_runner

        runner = speculative_runner(model, tokenizer, config, speculation)
    return Engine(model, tokenizer, config, runner=runner)


def vision_engine(model: Any, tokenizer: Any, config: EngineConfig | None = None) -> Engine:
    """An Engine with the vision runner start-up would hand it."""
    from mlx_server.engine.runners.vision import vision_runner

    setup = vision_runner(model, tokenizer, config)
    return Engine(setup.model, tokenizer, setup.config, runner=setup.runner)


async def until(condition: Callable[[], object], what: str, timeout: float = 60) -> None:
    """Wait (yielding to the event loop) until ``condition()`` holds; fail after ``timeout``
    seconds naming ``what`` was awaited."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


def held_disk_writer(monkeypatch: Any) -> threading.Event:
    """Hold the prefix cache's disk writer (a slow disk) until the returned event is set."""
    release = threading.Event()
    write = DiskPromptCache._write

    def slow(self: DiskPromptCache, job: Any) -> None:
        assert release.wait(30)
        write(self, job)

    monkeypatch.setattr(DiskPromptCache, "_write", slow)
    return release


@dataclass
class Result:
    text: str
    finished: Finished
    logprobs: list[LogprobEntry] = field(default_factory=list)
    pieces: int = 0

    @property
    def reason(self) -> str:
        return self.finished.reason

    @property
    def cached(self) -> int:
        return self.finished.usage.cached_tokens


_ids = iter(range(1 << 30))


def request(tokens: list[int], max_tokens: int = 24, **kw: Any) -> GenerationRequest:
    kw.setdefault("sampling", GREEDY)
    return GenerationRequest(f"req-{next(_ids)}", list(tokens), max_tokens, **kw)


async def collect(handle: GenerationHandle) -> Result:
    text, logprobs, pieces = "", [], 0
    async for ev in handle:
        if isinstance(ev, Started):
            continue
        if isinstance(ev, TokenPiece):
            text += ev.text
            logprobs.extend(ev.logprobs)
            pieces += 1
        else:
            return Result(text, ev, logprobs, pieces)
    raise AssertionError("the stream ended without Finished")


async def generate(engine: Engine, req: GenerationRequest) -> Result:
    return await collect(engine.submit(req))


async def generate_all(engine: Engine, reqs: list[GenerationRequest]) -> list[Result]:
    """Submit every request before awaiting any, so they run in one batch."""
    handles = [engine.submit(r) for r in reqs]
    return list(await asyncio.gather(*(collect(h) for h in handles)))


def solo(engine: Engine, reqs: list[GenerationRequest]) -> list[Result]:
    """Each request alone, one after another."""

    async def run() -> list[Result]:
        return [await generate(engine, r) for r in reqs]

    return drive(engine, run())


DEADLINE_S = 120.0


def drive(engine: Engine, work: Coroutine[Any, Any, T], timeout: float = DEADLINE_S) -> T:
    """``asyncio.run(work)`` with a deadline: a generation that never ends fails the test
    after ``timeout`` seconds with the engine's counters (what runs, prefills, waits),
    instead of hanging until the suite's own timeout."""

    async def bounded() -> T:
        try:
            return await asyncio.wait_for(work, timeout)
        except asyncio.TimeoutError:
            raise AssertionError(
                f"the engine work did not end within {timeout:.0f}s; engine: {engine.stats()}"
            ) from None

    return asyncio.run(bounded())


@contextmanager
def running_engine(model: Any, tokenizer: Any, **config: Any) -> Iterator[Engine]:
    config.setdefault("kv_bytes_per_token", 256)
    speculation = config.pop("speculation", None)
    engine = text_engine(model, tokenizer, EngineConfig(**config), speculation)
    engine.start()
    try:
        yield engine
    finally:
        engine.shutdown(timeout=10)


def chat_tokens(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def build_varied_model(path: Any, head_scale: float = 4.0) -> Any:
    """The tiny model with an untied, sharpened output head: with tied random embeddings
    greedy decoding repeats the input token, which would make output comparisons vacuous."""
    import json

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    from tiny_model import build_tiny_model

    path = build_tiny_model(path)
    config = json.loads((path / "config.json").read_text())
    config["tie_word_embeddings"] = False
    mx.random.seed(1)
    net = llama.Model(llama.ModelArgs.from_dict(config))
    weights = dict(tree_flatten(net.parameters()))
    weights["lm_head.weight"] = weights["lm_head.weight"] * head_scale
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config))
    return path


def load_varied_model(tmp_path_factory: Any) -> tuple[Any, Any, Any]:
    """(model, tokenizer, model_dir) for the varied tiny model."""
    from mlx_lm import load

    path = build_varied_model(tmp_path_factory.mktemp("varied") / "tiny-varied")
    model, tokenizer = load(str(path))[:2]
    return model, tokenizer, path
