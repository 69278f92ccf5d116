"""The prefix cache's disk tier: entries survive a restart, a corrupt or truncated file is
never used (deleted and logged instead), crash leftovers are cleaned at start, and the
directory stays within its bound."""

from __future__ import annotations

import json
import time
from pathlib import Path

import mlx.core as mx
import pytest
from engine_runner import chat_tokens, load_varied_model, request, running_engine, solo
from mlx_lm.models.cache import KVCache

from mlx_server.engine.cache.disk import MANIFEST, DiskPromptCache, model_cache_dir
from mlx_server.engine.cache.folder_lock import LOCK_FILE
from mlx_server.engine.cache.kv_quant import BatchableQuantizedKVCache
from mlx_server.engine.cache.prefix import SYSTEM, PrefixCache


def kv(n: int, layers: int = 2, start: int = 0) -> list[KVCache]:
    """KV layers holding ``n`` tokens whose values are their positions (+ ``start``), in a
    buffer longer than ``n`` (as a real cache's is)."""
    out = []
    for _ in range(layers):
        c = KVCache()
        pos = mx.arange(start, start + n + 7, dtype=mx.float32).reshape(1, 1, n + 7, 1)
        c.keys = mx.broadcast_to(pos, (1, 2, n + 7, 8))
        c.values = c.keys + 1
        c.offset = n
        out.append(c)
    return out


def entry_files(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


def reopen(d: Path, **kw) -> DiskPromptCache:
    kw.setdefault("min_tokens", 4)
    return DiskPromptCache(d, kw.pop("max_bytes", 1 << 30), **kw)


def stop(disk: DiskPromptCache) -> None:
    """The end of a process: queued writes finish, the folder is given up."""
    assert disk.close(10) and disk.released


def restart(disk: DiskPromptCache, **kw) -> DiskPromptCache:
    """A new process on the same folder, once the old one has ended: only the manifest is
    read."""
    stop(disk)
    return reopen(disk.directory, **kw)


def test_an_entry_survives_a_restart_with_its_tokens_and_values(tmp_path):
    disk = reopen(tmp_path)
    tokens = list(range(100, 120))
    assert disk.save(tokens, kv(20), "assistant")
    assert disk.flush(10)
    again = restart(disk)
    found = again.lookup(tokens + [7, 8])
    assert found is not None and found[1] == 20
    loaded = again.load(found[0])
    assert loaded is not None
    cache, stored, kind = loaded
    assert stored == tokens and kind == "assistant"
    assert cache[0].offset == 20 and cache[0].keys.shape == (1, 2, 20, 8)
    assert mx.array_equal(cache[1].values[0, 0, :, 0], mx.arange(20, dtype=mx.float32) + 1)
    assert again.stats()["prompt_cache_disk_hits"] == 1


def held_writer(disk: DiskPromptCache, monkeypatch):
    """Hold ``disk``'s writer (a slow disk) until the returned event is set."""
    import threading

    release = threading.Event()
    write = disk._write

    def slow_write(job):
        assert release.wait(30), "the test never released the writer"
        write(job)

    monkeypatch.setattr(disk, "_write", slow_write)
    return release


def test_states_beyond_the_waiting_writes_are_dropped_and_counted(tmp_path, monkeypatch):
    """With ``max_pending`` writes waiting (a slow disk), a new state is not queued: it is
    dropped, and the disk tier's counters say how many (``/health``)."""
    disk = reopen(tmp_path, max_pending=1, max_pending_bytes=0)
    release = held_writer(disk, monkeypatch)
    assert disk.save(list(range(100, 120)), kv(20), "assistant")
    assert not disk.save(list(range(200, 220)), kv(20), "assistant")
    assert not disk.save(list(range(300, 320)), kv(20), "assistant")
    assert disk.stats()["prompt_cache_disk_dropped"] == 2
    release.set()
    stop(disk)
    assert len(entry_files(tmp_path)) == 1


def test_beyond_the_slots_states_wait_while_their_bytes_fit(tmp_path, monkeypatch):
    """Streams finishing together each evict a state: beyond ``max_pending`` waiting writes,
    small states still wait for the writer while all of them hold at most
    ``max_pending_bytes``; the one that would pass it is dropped. All the taken ones are
    written once the writer goes on."""
    disk = reopen(tmp_path, max_pending=1, max_pending_bytes=0)
    release = held_writer(disk, monkeypatch)
    assert disk.save(list(range(100, 120)), kv(20), "assistant")  # the slot
    one = disk.pending_bytes  # a 20-token state's arrays and its tokens
    disk.max_pending_bytes = 3 * one
    taken = [disk.save(list(range(s, s + 20)), kv(20), "assistant") for s in (200, 300)]
    assert taken == [True, True] and disk.pending_bytes == 3 * one
    assert not disk.save(list(range(400, 420)), kv(20), "assistant")
    assert disk.stats()["prompt_cache_disk_dropped"] == 1
    release.set()
    stop(disk)
    assert len(entry_files(tmp_path)) == 3


def test_a_saved_state_reaches_the_writer_three_steps_later_or_when_idle(tmp_path, monkeypatch):
    """``save`` only starts the state's evaluation (waiting for it would wait for the step in
    flight); the engine's ``settle`` before each step hands the writer the states saved three
    steps ago, and all of them once it goes idle. Written and read back all the same."""
    disk = reopen(tmp_path)
    handed: list[list[int]] = []
    put = disk._queue.put

    def recorded(job, *args, **kwargs):
        if job is not None:
            handed.append(job.tokens.tolist())
        put(job, *args, **kwargs)

    monkeypatch.setattr(disk._queue, "put", recorded)
    first, second = list(range(100, 120)), list(range(200, 230))
    assert disk.save(first, kv(20), "assistant")
    disk.settle()
    disk.settle()
    assert handed == [] and disk.is_queued(disk.lookup(first, 0)[0])  # served from memory
    disk.settle()
    assert handed == [first]
    assert disk.save(second, kv(30, start=5), "assistant")
    disk.settle(everything=True)
    assert handed == [first, second]
    disk = restart(disk)
    cache, tokens, _ = disk.load(disk.lookup(second, 0)[0])
    assert tokens == second and cache[0].keys[0, 0, :, 0].tolist() == list(range(5, 35))


def test_a_prompt_that_diverges_keeps_only_the_shared_prefix(tmp_path):
    disk = reopen(tmp_path)
    disk.save(list(range(50)), kv(50), "assistant")
    disk.flush(10)
    assert disk.lookup(list(range(30)) + [999, 998]) == (disk.lookup(list(range(50)))[0], 30)  # type: ignore[index]
    assert disk.lookup(list(range(50)))[1] == 49  # type: ignore[index]  # last token recomputed
    assert disk.lookup([5, 6, 7, 8, 9]) is None


def test_quantized_entries_round_trip(tmp_path):
    disk = reopen(tmp_path)
    c = BatchableQuantizedKVCache(group_size=32, bits=8)
    x = mx.random.normal((1, 2, 40, 64))
    c.update_and_fetch(x, x * 2)
    c.trim(10)  # 30 tokens in a 256-slot buffer
    tokens = list(range(30))
    assert disk.save(tokens, [c], "assistant") and disk.flush(10)
    name = disk.lookup(tokens + [1])[0]  # type: ignore[index]
    loaded = restart(disk).load(name)
    assert loaded is not None
    (back,) = loaded[0]
    assert isinstance(back, BatchableQuantizedKVCache) and (back.bits, back.group_size) == (8, 32)
    assert back.offset == 30 and back.keys[0].shape[-2] == 30
    deq = mx.dequantize(*back.keys, group_size=32, bits=8)
    assert mx.allclose(deq, x[..., :30, :], atol=0.05)


@pytest.mark.parametrize("damage", ["flip", "truncate_while_running"])
def test_a_damaged_entry_is_deleted_logged_and_never_used(tmp_path, capsys, damage):
    disk = reopen(tmp_path)
    tokens = list(range(64))
    disk.save(tokens, kv(64), "assistant")
    disk.flush(10)
    (path,) = entry_files(tmp_path)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        stop(disk)
        data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
        path.write_bytes(bytes(data))
        disk = reopen(tmp_path)
    else:
        path.write_bytes(bytes(data[: len(data) // 2]))
    pc = PrefixCache(4, 1 << 30, disk=disk)
    cache, rest = pc.fetch(tokens + [1, 2])
    assert cache is None and rest == tokens + [1, 2]
    assert not path.exists()
    assert disk.stats()["prompt_cache_disk_corrupt"] == 1
    assert "dropping unreadable entry" in capsys.readouterr().out
    assert disk.lookup(tokens + [1, 2]) is None


def test_crash_leftovers_are_cleaned_at_start(tmp_path):
    disk = reopen(tmp_path)
    disk.save(list(range(30)), kv(30), "assistant")
    disk.save(list(range(500, 540)), kv(40), "assistant")
    stop(disk)
    a, b = entry_files(tmp_path)
    (tmp_path / ".tmp-deadbeef-1-2.safetensors").write_bytes(b"half a file")  # killed mid-write
    (tmp_path / "0123456789abcdef.safetensors").write_bytes(b"renamed, not yet listed")
    b.unlink()  # listed, but gone
    truncated = a.read_bytes()[:100]
    again = reopen(tmp_path)
    assert [f.name for f in tmp_path.iterdir() if f.name not in (MANIFEST, LOCK_FILE)] == [a.name]
    assert again.stats()["prompt_cache_disk_entries"] == 1
    stop(again)
    a.write_bytes(truncated)  # listed with another size: dropped at the next start
    assert reopen(tmp_path).stats()["prompt_cache_disk_entries"] == 0
    assert entry_files(tmp_path) == []


def test_an_unreadable_manifest_starts_empty(tmp_path):
    disk = reopen(tmp_path)
    disk.save(list(range(30)), kv(30), "assistant")
    stop(disk)
    (tmp_path / MANIFEST).write_text('{"version": 1, "entries": {"x": ')
    again = reopen(tmp_path)
    assert again.stats()["prompt_cache_disk_entries"] == 0 and entry_files(tmp_path) == []
    assert again.save(list(range(30)), kv(30), "assistant") and again.flush(10)
    assert json.loads((tmp_path / MANIFEST).read_text())["entries"]


def test_200_distinct_prompts_keep_the_directory_within_its_bound(tmp_path):
    one = 2 * 2 * 2 * 64 * 8 * 4  # layers x (keys, values) x heads x tokens x dim x 4 bytes
    bound = 10 * one
    disk = reopen(tmp_path, max_bytes=bound)
    pc = PrefixCache(2, 1 << 30, disk=disk)  # RAM holds two: the rest go to disk
    for i in range(200):
        tokens = [10_000 + i] + list(range(63))
        pc.insert(tokens, kv(64, start=i))
        deadline = time.monotonic() + 60
        while disk.busy:  # the writer is behind: wait rather than let it drop entries
            assert time.monotonic() < deadline, "the disk writer is stuck"
            disk.flush(0.05)
    disk.flush(30)
    files = list(tmp_path.iterdir())
    entries = sum(f.stat().st_size for f in files if f.suffix == ".safetensors")
    manifest = (tmp_path / MANIFEST).stat().st_size
    assert entries <= bound
    assert entries + manifest <= bound + 64 * 1024
    stats = disk.stats()
    assert 5 <= stats["prompt_cache_disk_entries"] <= 10
    assert stats["prompt_cache_disk_written_bytes"] > 100 * one  # ~198 were written
    # Least recently used went first: the newest evicted prompt is still there.
    assert disk.lookup([10_000 + 197] + list(range(63)) + [5]) is not None
    assert disk.lookup([10_000 + 3] + list(range(63)) + [5]) is None


def test_ram_evictions_reach_disk_and_are_served_from_there(tmp_path):
    disk = reopen(tmp_path)
    pc = PrefixCache(1, 1 << 30, disk=disk)
    a, b = list(range(40)), list(range(1000, 1040))
    pc.insert(a, kv(40))
    pc.insert(b, kv(40, start=1000))  # evicts a: written to disk
    disk.flush(10)
    assert pc.cached_length(a[:20] + [7]) == 20
    cache, rest = pc.fetch(a[:20] + [7])
    assert rest == [7] and cache is not None and cache[0].offset == 20
    assert mx.array_equal(cache[0].keys[0, 0, :20, 0], mx.arange(20, dtype=mx.float32))
    assert pc.keys() == [b]  # served from disk, not copied into RAM
    stats = pc.stats()
    assert stats["prompt_cache_disk_hits"] == 1 and stats["prompt_cache_hits"] == 1


def test_system_entries_are_written_through_and_close_writes_the_rest(tmp_path):
    disk = reopen(tmp_path)
    pc = PrefixCache(4, 1 << 30, disk=disk)
    sys_tokens, conv = list(range(30)), list(range(30)) + list(range(200, 230))
    pc.insert(sys_tokens, kv(30), SYSTEM)
    disk.flush(10)
    assert disk.stats()["prompt_cache_disk_entries"] == 1  # written at once
    pc.insert(conv, kv(60))
    pc.close(timeout=10)
    assert disk.released  # closing the prefix cache closes its disk tier
    again = reopen(tmp_path)
    assert again.lookup(conv + [1])[1] == 60  # type: ignore[index]
    assert again.lookup(sys_tokens + [9, 9])[1] == 30  # type: ignore[index]


def test_the_directory_depends_on_the_model_and_the_kv_layout(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"num_hidden_layers": 2}')
    (model / "model.safetensors").write_bytes(b"w")
    base = model_cache_dir(tmp_path, model, {"kv_bits": None})
    assert base == model_cache_dir(tmp_path, model, {"kv_bits": None})
    assert base != model_cache_dir(tmp_path, model, {"kv_bits": 8})
    (model / "model.safetensors").write_bytes(b"other weights")
    assert base != model_cache_dir(tmp_path, model, {"kv_bits": None})


# ---- the engine on the tiny model ------------------------------------------------------


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return load_varied_model(tmp_path_factory)


def test_a_restarted_engine_serves_the_prompt_from_disk_with_the_same_output(lm, tmp_path):
    model, tokenizer, _ = lm
    msgs = [
        {"role": "system", "content": "You are a terse assistant. " * 40},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    prompt = chat_tokens(tokenizer, msgs)
    system_end = len(chat_tokens(tokenizer, msgs[:1])) - 3
    req = lambda: request(prompt, 16, system_prefix_tokens=system_end)  # noqa: E731
    with running_engine(model, tokenizer, prompt_cache_size=0) as engine:
        (plain,) = solo(engine, [req()])
    for _ in range(2):  # the second start finds the first one's entries
        # The first engine's shutdown closes its disk tier; a write still running past its
        # deadline keeps the folder a moment longer.
        disk = DiskPromptCache(tmp_path, 1 << 30, min_tokens=64, lock_wait_s=30)
        with running_engine(model, tokenizer, prompt_cache_disk=disk) as engine:
            (res,) = solo(engine, [req()])
            stats = engine.stats()
        assert res.text == plain.text
    assert res.cached == len(prompt) - 1
    assert stats["prompt_cache_disk_hits"] == 1 and stats["prompt_cache_disk_read_bytes"] > 0


def test_the_default_directory_follows_the_environment(monkeypatch, tmp_path):
    from mlx_server.engine.cache.disk import default_root

    monkeypatch.delenv("MLX_SERVER_PROMPT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_root() == tmp_path / "xdg" / "mlx-server" / "prompt-cache"
    monkeypatch.setenv("MLX_SERVER_PROMPT_CACHE_DIR", str(tmp_path / "explicit"))
    assert default_root() == tmp_path / "explicit"


def test_an_empty_prompt_cache_dir_turns_the_disk_tier_off(lm, tmp_path):
    from types import SimpleNamespace

    from mlx_server.boot.disk_tier import disk_tier as _disk_tier
    from mlx_server.config import Settings

    model, _, path = lm
    loaded = SimpleNamespace(
        model=model, path=path, config=json.loads((path / "config.json").read_text())
    )
    off, reason = _disk_tier(loaded, Settings(model=str(path), prompt_cache_dir=""))
    assert off is None and "--prompt-cache-dir" in reason
    disk, reason = _disk_tier(loaded, Settings(model=str(path), prompt_cache_dir=str(tmp_path)))
    assert disk is not None and reason == "" and disk.directory.parent == tmp_path
    assert disk.directory.name.startswith(path.name + "-")
    stop(disk)
