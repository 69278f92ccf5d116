"""The prefix cache's tiers for long conversations: the RAM tier is sized from the KV budget,
a state larger than the tier is logged and counted (never dropped silently), a state on its
way to disk is served from memory, and a disk hit is read off the engine thread."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest
from engine_runner import (
    chat_tokens,
    held_disk_writer,
    load_varied_model,
    request,
    running_engine,
    solo,
)
from test_disk_cache import entry_files, kv, reopen, stop

from mlx_server.boot.memory import prompt_cache_bytes
from mlx_server.config import Settings
from mlx_server.engine.cache.disk import DiskPromptCache
from mlx_server.engine.cache.prefix import PrefixCache


def wait_for(cond, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_the_ram_tier_defaults_to_the_kv_budget_and_the_flag_wins():
    assert prompt_cache_bytes(Settings(model="m"), 24 << 30) == 24 << 30
    assert prompt_cache_bytes(Settings(model="m", prompt_cache_gb=1.5), 24 << 30) == 3 << 29


def test_a_state_larger_than_the_ram_tier_is_logged_and_counted(capsys):
    pc = PrefixCache(4, 1000)
    pc.insert(list(range(40)), kv(40))  # 2 layers x 2 x 2 x 47 x 8 float32: over 1000 bytes
    assert len(pc) == 0 and pc.stats()["prompt_cache_oversize"] == 1
    out = capsys.readouterr().out
    assert "larger than the RAM tier" in out and "not kept (no disk tier)" in out


def test_a_state_larger_than_the_ram_tier_goes_to_disk(tmp_path, capsys):
    disk = reopen(tmp_path)
    pc = PrefixCache(4, 1000, disk=disk)
    tokens = list(range(40))
    pc.insert(tokens, kv(40))
    assert disk.flush(10)
    assert "kept on disk only" in capsys.readouterr().out
    assert pc.stats()["prompt_cache_oversize"] == 1 and len(entry_files(tmp_path)) == 1
    assert pc.cached_length(tokens + [5]) == 40


def test_a_state_waiting_to_be_written_is_served_from_memory(tmp_path, monkeypatch):
    release = held_disk_writer(monkeypatch)
    disk = reopen(tmp_path)
    pc = PrefixCache(4, 1000, disk=disk)
    tokens = list(range(40))
    pc.insert(tokens, kv(40))
    assert not entry_files(tmp_path) and disk.is_queued(disk.lookup(tokens + [1])[0])  # type: ignore[index]
    assert pc.prepare(tokens + [1])  # nothing to read: it is in memory
    cache, rest = pc.fetch(tokens + [1])
    assert rest == [1] and cache is not None and cache[0].offset == 40
    assert mx.array_equal(cache[1].keys[0, 0, :, 0], mx.arange(40, dtype=mx.float32))
    release.set()
    assert disk.flush(10) and len(entry_files(tmp_path)) == 1
    assert not disk.is_queued(disk.lookup(tokens + [1])[0])  # type: ignore[index]


def test_a_disk_hit_is_read_on_the_loader_thread(tmp_path, monkeypatch):
    disk = reopen(tmp_path)
    tokens = list(range(50))
    assert disk.save(tokens, [c for c in kv(50)], "assistant") and disk.flush(10)
    readers: list[str] = []
    read = DiskPromptCache._read

    def record(self, name):
        readers.append(threading.current_thread().name)
        return read(self, name)

    monkeypatch.setattr(DiskPromptCache, "_read", record)
    monkeypatch.setattr(DiskPromptCache, "load", lambda *a: pytest.fail("read on the caller"))
    woken = threading.Event()
    pc = PrefixCache(4, 1 << 30, disk=disk)
    pc.on_loaded = woken.set
    prompt = tokens + [7, 8]
    assert not pc.prepare(prompt) and woken.wait(20)  # started, and done later
    assert pc.prepare(prompt) and not pc.loading
    cache, rest = pc.fetch(prompt)
    assert rest == [7, 8] and cache is not None and cache[0].offset == 50
    assert mx.array_equal(cache[0].values[0, 1, :, 3], mx.arange(50, dtype=mx.float32) + 1)
    assert readers == ["prompt-cache-load_0"]
    assert disk.stats()["prompt_cache_disk_hits"] == 1


def test_bfloat16_states_survive_the_loader(tmp_path):
    disk = reopen(tmp_path)
    layers = kv(30)
    for c in layers:
        c.keys, c.values = c.keys.astype(mx.bfloat16), c.values.astype(mx.bfloat16)
    tokens = list(range(30))
    assert disk.save(tokens, layers, "assistant") and disk.flush(10)
    name = disk.lookup(tokens + [1])[0]  # type: ignore[index]
    got = disk.read_async(name).result(20)
    cache = disk.materialize(got)
    assert cache is not None and cache[0].keys.dtype == mx.bfloat16
    assert mx.array_equal(cache[0].keys, layers[0].keys[..., :30, :])


def test_a_damaged_file_read_by_the_loader_is_deleted_and_missed(tmp_path, capsys):
    disk = reopen(tmp_path)
    tokens = list(range(64))
    disk.save(tokens, kv(64), "assistant")
    disk.flush(10)
    (path,) = entry_files(tmp_path)
    stop(disk)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    disk = reopen(tmp_path)
    pc = PrefixCache(4, 1 << 30, disk=disk)
    prompt = tokens + [1]
    assert not pc.prepare(prompt)
    wait_for(lambda: not pc.loading)
    assert pc.prepare(prompt)  # gone: nothing left to read
    assert pc.fetch(prompt) == (None, prompt)
    assert not path.exists() and disk.stats()["prompt_cache_disk_corrupt"] == 1
    assert "dropping unreadable entry" in capsys.readouterr().out


# ---- the engine on the tiny model ------------------------------------------------------


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return load_varied_model(tmp_path_factory)


def agent_turns(tokenizer) -> tuple[list[int], list[int], int]:
    msgs = [
        {"role": "system", "content": "Rule: answer tersely and exactly. " * 60},
        {"role": "user", "content": "List the files."},
    ]
    first = chat_tokens(tokenizer, msgs)
    second = first + list(tokenizer.encode(" and now the tests, please"))
    return first, second, len(chat_tokens(tokenizer, msgs[:1])) - 3


def test_the_next_turn_is_cached_while_the_last_is_still_being_written(lm, tmp_path, monkeypatch):
    model, tokenizer, _ = lm
    first, second, system_end = agent_turns(tokenizer)
    with running_engine(model, tokenizer, prompt_cache_size=0) as engine:
        (cold,) = solo(engine, [request(second, 12, system_prefix_tokens=system_end)])
    release = held_disk_writer(monkeypatch)
    disk = DiskPromptCache(tmp_path, 1 << 30, min_tokens=64)
    try:  # a RAM tier too small for one state: everything goes to disk
        with running_engine(
            model, tokenizer, prompt_cache_disk=disk, prompt_cache_bytes=1 << 12
        ) as engine:
            solo(engine, [request(first, 12, system_prefix_tokens=system_end)])
            (warm,) = solo(engine, [request(second, 12, system_prefix_tokens=system_end)])
            stats = engine.stats()
    finally:
        release.set()
    assert warm.text == cold.text
    assert warm.cached >= system_end
    assert stats["prompt_cache_oversize"] >= 2 and stats["prompt_cache_entries"] == 0


def test_an_engine_reads_a_disk_hit_off_its_thread_with_the_same_output(lm, tmp_path, monkeypatch):
    model, tokenizer, _ = lm
    first, second, system_end = agent_turns(tokenizer)
    with running_engine(model, tokenizer, prompt_cache_size=0) as engine:
        (cold,) = solo(engine, [request(second, 12)])
    disk = DiskPromptCache(tmp_path, 1 << 30, min_tokens=64)
    with running_engine(model, tokenizer, prompt_cache_disk=disk) as engine:
        solo(engine, [request(first, 12)])
    readers: list[str] = []
    read = DiskPromptCache._read
    monkeypatch.setattr(
        DiskPromptCache,
        "_read",
        lambda self, name: readers.append(threading.current_thread().name) or read(self, name),
    )
    monkeypatch.setattr(DiskPromptCache, "load", lambda *a: pytest.fail("read on the engine"))
    # A restart: RAM is empty (the first engine's shutdown gave the folder up).
    disk = DiskPromptCache(Path(tmp_path), 1 << 30, min_tokens=64, lock_wait_s=30)
    with running_engine(model, tokenizer, prompt_cache_disk=disk) as engine:
        (warm,) = solo(engine, [request(second, 12)])
        stats = engine.stats()
    assert warm.text == cold.text and warm.cached >= len(first)
    assert readers and all(r.startswith("prompt-cache-load") for r in readers)
    assert stats["prompt_cache_disk_hits"] == 1


def test_reads_ahead_are_bounded_and_stale_ones_are_forgotten(tmp_path, monkeypatch):
    import mlx_server.engine.cache.prefix_disk as prefix_cache

    disk = reopen(tmp_path)
    a, b = list(range(40)), list(range(500, 540))
    assert disk.save(a, kv(40), "assistant") and disk.save(b, kv(40, start=500), "assistant")
    assert disk.flush(10)
    monkeypatch.setattr(prefix_cache, "_MAX_READS", 1)
    pc = PrefixCache(4, 1 << 30, disk=disk)
    assert not pc.prepare(a + [1])  # A's read starts; its request then goes away
    wait_for(lambda: not pc.loading)
    assert pc.prepare(b + [1])  # no room to read ahead: fetch reads B itself
    cache, rest = pc.fetch(b + [1])
    assert rest == [1] and cache is not None
    assert mx.array_equal(cache[0].keys[0, 0, :, 0], mx.arange(500, 540, dtype=mx.float32))
    monkeypatch.setattr(prefix_cache, "_STALE_READ_S", 0.0)
    assert not pc.prepare(b + [2])  # A's untaken read is stale now: B is read ahead
