"""The model registry on its own: a loader that records what it loads, fake engines whose
load the test can hold, and a clock the test moves."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from dataclasses import dataclass, field

import pytest

from mlx_server.errors import InvalidRequest, NotFound, Overloaded
from mlx_server.registry.catalog import Offer, model_kind, scan_dir
from mlx_server.registry.keep_alive import parse_keep_alive
from mlx_server.registry.registry import Limits, ModelRegistry

MB = 1 << 20


class FakeModel:
    def parameters(self) -> dict:
        return {}


@dataclass
class FakeEngine:
    active_count: int = 0
    queue_depth: int = 0
    stopped: bool = False

    def shutdown(self, timeout: float = 3.0) -> None:
        self.stopped = True


@dataclass
class FakeParts:
    engine: FakeEngine = field(default_factory=FakeEngine)
    loaded: object = field(default_factory=lambda: type("L", (), {"model": FakeModel()})())
    service: object = None


class Loader:
    def __init__(self) -> None:
        self.loads: list[str] = []
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, offer: Offer) -> FakeParts:
        assert self.gate.wait(10), "the test never let the load finish"
        self.loads.append(offer.id)
        return FakeParts()


class Clock:
    """The registry's clock; counts its reads (the reaper reads it once per pass)."""

    now = 1000.0

    def __init__(self) -> None:
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


async def until(condition, what: str, timeout: float = 10.0) -> None:
    """Wait for ``condition()`` to hold; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def make(ids=("a", "b", "c"), *, memory=100 * MB, max_loaded=0, idle=0.0, pinned=(), kind="chat"):
    offers = [Offer(i, f"/m/{i}", kind, 0) for i in ids]
    loader, clock = Loader(), Clock()
    limits = Limits(memory, max_loaded, idle, max_waiting=4, overhead_bytes=40 * MB)
    return ModelRegistry(offers, limits, loader, pinned=pinned, clock=clock), loader, clock


def states(reg: ModelRegistry) -> dict[str, str]:
    return {i: s.state for i, s in reg.slots.items()}


async def use(reg: ModelRegistry, model: str, clock: Clock, keep_alive=None) -> None:
    clock.now += 1
    slot = await reg.acquire(model, keep_alive)
    reg.release(slot)


def test_the_least_recently_used_idle_model_makes_room():
    async def run():
        reg, loader, clock = make()  # room for two models of 40 MB in 100 MB
        await use(reg, "a", clock)
        await use(reg, "b", clock)
        await use(reg, "a", clock)  # b is now the least recently used
        await use(reg, "c", clock)
        assert states(reg) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
        assert loader.loads == ["a", "b", "c"]

    asyncio.run(run())


def test_a_model_serving_a_request_is_never_unloaded_for_room():
    async def run():
        reg, _, clock = make(max_loaded=2)
        held = await reg.acquire("a")  # a request still running on a
        await use(reg, "b", clock)
        await use(reg, "c", clock)  # b goes, a stays
        assert states(reg) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
        reg.slots["c"].parts.engine.active_count = 1  # c is generating
        with pytest.raises(Overloaded, match="busy"):
            await reg.acquire("b")
        reg.release(held)

    asyncio.run(run())


def test_models_max_caps_the_loaded_models():
    async def run():
        reg, _, clock = make(memory=10_000 * MB, max_loaded=1)
        await use(reg, "a", clock)
        await use(reg, "b", clock)
        assert states(reg) == {"a": "unloaded", "b": "loaded", "c": "unloaded"}

    asyncio.run(run())


def test_concurrent_requests_wait_for_one_load():
    async def run():
        reg, loader, _ = make()
        loader.gate.clear()
        tasks = [asyncio.ensure_future(reg.acquire("a")) for _ in range(4)]
        await until(lambda: reg.slots["a"].state == "loading", "the load to start")
        loader.gate.set()
        slots = await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert loader.loads == ["a"] and {s.id for s in slots} == {"a"}
        assert reg.slots["a"].leases == 4

    asyncio.run(run())


def test_too_many_waiting_for_a_load_is_overloaded():
    async def run():
        reg, loader, _ = make()
        loader.gate.clear()
        tasks = [asyncio.ensure_future(reg.acquire("a")) for _ in range(4)]
        await until(lambda: reg.slots["a"].waiting == 4, "four requests waiting")
        with pytest.raises(Overloaded):
            await reg.acquire("a")
        loader.gate.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)

    asyncio.run(run())


def test_idle_time_keep_alive_and_pins():
    async def run():
        reg, _, clock = make(memory=10_000 * MB, idle=60, pinned=("c",))
        await reg.load("c")
        await use(reg, "a", clock)
        await use(reg, "b", clock, keep_alive=math.inf)
        clock.now += 58  # a idle 59 s
        assert not reg.expired(reg.slots["a"], clock.now)
        clock.now += 2
        assert reg.expired(reg.slots["a"], clock.now)
        assert not reg.expired(reg.slots["b"], clock.now + 1e9)  # keep_alive -1
        assert not reg.expired(reg.slots["c"], clock.now + 1e9)  # pinned
        with pytest.raises(InvalidRequest, match="pinned"):
            await reg.unload("c")

    asyncio.run(run())


def test_keep_alive_zero_unloads_once_the_request_ends():
    async def run():
        reg, _, clock = make()
        slot = await reg.acquire("a", keep_alive=0)
        reads = clock.reads

        # Two passes of the reaper (one clock read each) have looked at the expired slot...
        def reaper_passed() -> bool:  # (or the slot is gone, which fails below)
            return clock.reads >= reads + 2 or slot.state != "loaded"

        await until(reaper_passed, "two passes of the reaper")
        assert slot.state == "loaded"  # ...and left it: its request holds it
        reg.release(slot)
        await until(lambda: slot.state == "unloaded", "the unload")
        assert slot.unloads == 1

    asyncio.run(run())


def test_an_unload_asked_during_the_load_is_kept_by_the_request_that_waited_for_it():
    """The request that started the load gives its own keep_alive once the load ends; an
    unload asked meanwhile must not be lost to it (it was: the model stayed loaded)."""

    async def run():
        reg, loader, _ = make()
        loader.gate.clear()  # the load waits for the test
        waiting = asyncio.create_task(reg.acquire("a"))
        slot = reg.slots["a"]
        await until(lambda: slot.state == "loading", "the load to start")
        assert await reg.unload("a") == "loading"
        loader.gate.set()
        got = await waiting
        assert got is slot and slot.state == "loaded"  # the waiting request is served
        reg.release(slot)
        await until(lambda: slot.state == "unloaded", "the unload asked during the load")
        assert slot.unloads == 1
        # a later request keeps it as usual (no unload is pending any more)
        again = await reg.acquire("a")
        reg.release(again)
        assert again.state == "loaded" and not again.unload_asked

    asyncio.run(run())


def test_unknown_and_embedding_models():
    async def run():
        reg, _, _ = make()
        with pytest.raises(NotFound) as e:
            await reg.acquire("nope")
        assert e.value.code == "model_not_found" and "a, b, c" in e.value.message
        emb, loader, _ = make(("e",), kind="embedding")
        with pytest.raises(InvalidRequest, match="embedding model") as e:
            await emb.acquire("e")  # a chat request
        assert (e.value.param, e.value.code) == ("model", "model_not_supported")
        with pytest.raises(InvalidRequest, match="chat model"):
            await reg.acquire("a", serves="embedding")
        assert loader.loads == [] and states(reg) == dict.fromkeys("abc", "unloaded")

    asyncio.run(run())


def test_embedding_models_load_count_no_kv_budget_and_unload_like_chat_models():
    async def run():
        offers = [Offer("chat", "/m/chat", "chat", 0), Offer("emb", "/m/emb", "embedding", 0)]
        limits = Limits(50 * MB, 0, 0.0, max_waiting=4, overhead_bytes=40 * MB)
        loader, clock = Loader(), Clock()
        reg = ModelRegistry(offers, limits, loader, clock=clock)
        slot = await reg.acquire("emb", None, serves="embedding")
        reg.release(slot)
        assert slot.memory_bytes == 0  # its weights (none here), no KV budget
        await use(reg, "chat", clock)  # 40MB: both fit in 50MB
        assert states(reg) == {"chat": "loaded", "emb": "loaded"}
        clock.now += 1
        slot = await reg.acquire("emb", 0, serves="embedding")
        reg.release(slot)  # keep_alive 0: unloaded once its response ends
        await until(lambda: slot.state == "unloaded", "keep_alive 0 to unload")
        assert states(reg) == {"chat": "loaded", "emb": "unloaded"}
        assert loader.loads == ["emb", "chat"]
        await reg.load("emb")  # the management route loads any kind
        assert slot.state == "loaded" and slot.loads == 2

    asyncio.run(run())


def test_a_request_without_a_model_gets_the_first_model_of_its_kind():
    """``--models-dir`` lists models by name, so an embedding model may come first: a chat
    request that names no model gets the first chat model, an embeddings request the first
    embedding model; a named model of the wrong kind is still a 400."""

    async def run():
        offers = [Offer("a-emb", "/m/e", "embedding", 0), Offer("b-chat", "/m/c", "chat", 0)]
        limits = Limits(500 * MB, 0, 0.0, max_waiting=4, overhead_bytes=MB)
        loader = Loader()
        reg = ModelRegistry(offers, limits, loader, clock=Clock())
        chat = await reg.acquire("")
        emb = await reg.acquire("", serves="embedding")
        assert (chat.id, emb.id) == ("b-chat", "a-emb") and reg.slot("").id == "a-emb"
        with pytest.raises(InvalidRequest, match="embedding model"):
            await reg.acquire("a-emb")
        only_emb, _, _ = make(("e",), kind="embedding")
        with pytest.raises(InvalidRequest, match="embedding model"):
            await only_emb.acquire("")  # no chat model at all: the default's kind says so

    asyncio.run(run())


def test_a_rerank_request_without_a_model_gets_the_first_reranker(tmp_path):
    """Embedders and rerankers are both embedding-kind models: without a model, a rerank
    request gets the first reranker and an embeddings request the first embedder, in either
    order of offer; with one of them only, that one (whose service then says what it does)."""
    bert = {"model_type": "bert", "hidden_size": 8, "max_position_embeddings": 64}
    configs = {
        "emb": {**bert, "architectures": ["BertModel"]},
        "rank": {**bert, "architectures": ["BertForSequenceClassification"], "num_labels": 1},
    }
    for name, config in configs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))

    def offer(name: str) -> Offer:
        return Offer(f"x-{name}", str(tmp_path / name), "embedding", 0)

    async def run():
        limits = Limits(500 * MB, 0, 0.0, max_waiting=4, overhead_bytes=MB)
        chat = Offer("chat", "/m/c", "chat", 0)
        for encoders in (["emb", "rank"], ["rank", "emb"]):
            reg = ModelRegistry([chat, *map(offer, encoders)], limits, Loader(), clock=Clock())
            rank = await reg.acquire("", serves="rerank")
            emb = await reg.acquire("", serves="embedding")
            assert (rank.id, emb.id) == ("x-rank", "x-emb"), encoders
            assert (await reg.acquire("")).id == "chat"
        for only in ("emb", "rank"):
            reg = ModelRegistry([chat, offer(only)], limits, Loader(), clock=Clock())
            for serves in ("embedding", "rerank"):
                assert (await reg.acquire("", serves=serves)).id == f"x-{only}"
        with pytest.raises(InvalidRequest, match="chat model"):
            await reg.acquire("chat", serves="rerank")

    asyncio.run(run())


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (None, None),
        (0, 0.0),
        ("0", 0.0),
        (300, 300.0),
        ("300", 300.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("1.5s", 1.5),
        ("250ms", 0.25),
        (-1, math.inf),
        ("-1", math.inf),
        ("-1m", math.inf),
    ],
)
def test_keep_alive_values(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 minutes", "", True, [1], "5x"])
def test_bad_keep_alive_names_the_field(value):
    with pytest.raises(InvalidRequest) as e:
        parse_keep_alive(value)
    assert e.value.param == "keep_alive"


def test_models_dir_finds_mlx_dirs_gguf_files_and_hub_entries(tmp_path):
    (tmp_path / "mlx-model").mkdir()
    (tmp_path / "mlx-model" / "config.json").write_text("{}")
    (tmp_path / "notes").mkdir()  # no config.json: not a model
    (tmp_path / "small.Q4_0.gguf").write_bytes(b"GGUF")
    snap = tmp_path / "models--org--Some-Model-1.5B" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    (tmp_path / "models--org--Some-Model-1.5B" / "refs").mkdir()
    (tmp_path / "models--org--Some-Model-1.5B" / "refs" / "main").write_text("abc123")
    found = dict(scan_dir(tmp_path))
    assert found == {
        "mlx-model": tmp_path / "mlx-model",
        "small.Q4_0": tmp_path / "small.Q4_0.gguf",
        "org/Some-Model-1.5B": snap,
    }


def test_model_kinds_from_the_config(tmp_path):
    chat, encoder = tmp_path / "chat", tmp_path / "encoder"
    for d, config in (
        (chat, '{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}'),
        (encoder, '{"model_type": "bert", "architectures": ["BertModel"]}'),
    ):
        d.mkdir()
        (d / "config.json").write_text(config)
    assert (model_kind(chat), model_kind(encoder)) == ("chat", "embedding")


def test_a_latest_tag_names_the_model_itself():
    """Ollama's clients send ``<id>:latest``; any other tag is not an offered model."""
    reg, _, _ = make()
    assert reg.slot("b:latest") is reg.slot("b")
    with pytest.raises(NotFound):
        reg.slot("b:q4")
