"""One disk tier per folder: a second cache on a folder that another one holds leaves it
alone (the holder's entries and half-written files survive) and the server runs without a
disk tier, saying why; a holder killed with ``kill -9`` leaves no stale lock; a holder that
is closing is waited for."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
from engine_runner import held_disk_writer, load_varied_model
from test_disk_cache import entry_files, kv, reopen, stop

from mlx_server.engine.cache.disk import MANIFEST, DiskPromptCache
from mlx_server.engine.cache.folder_lock import LOCK_FILE, FolderLocked
from mlx_server.engine.cache.prefix import PrefixCache


def snapshot(d: Path) -> dict[str, bytes]:
    """Every file of the folder but the lock, with its contents."""
    return {f.name: f.read_bytes() for f in d.iterdir() if f.name != LOCK_FILE}


def test_a_second_cache_on_a_held_folder_is_refused_and_touches_nothing(tmp_path):
    first = reopen(tmp_path)
    assert first.save(list(range(40)), kv(40), "assistant") and first.flush(10)
    # The holder's write in flight, and an entry renamed but not listed yet: a start-up
    # that owned the folder would delete both.
    (tmp_path / ".tmp-0123-1-2.safetensors").write_bytes(b"being written")
    (tmp_path / "fedcba9876543210.safetensors").write_bytes(b"not listed yet")
    before = snapshot(tmp_path)
    with pytest.raises(FolderLocked) as refused:
        reopen(tmp_path)
    assert refused.value.pid == os.getpid() and refused.value.directory == tmp_path
    assert not refused.value.closing
    assert snapshot(tmp_path) == before
    # The holder goes on as before.
    assert first.save(list(range(500, 540)), kv(40), "assistant") and first.flush(10)
    assert len(json.loads((tmp_path / MANIFEST).read_text())["entries"]) == 2
    stop(first)
    again = reopen(tmp_path)  # the folder is free once its holder has closed
    assert again.stats()["prompt_cache_disk_entries"] == 2
    assert not (tmp_path / ".tmp-0123-1-2.safetensors").exists()  # the owner cleans up
    stop(again)


_HOLDER = """
import sys, time
from mlx_server.engine.cache.disk import DiskPromptCache
disk = DiskPromptCache(sys.argv[1], 1 << 30)
print("holding", flush=True)
time.sleep(120)
"""


def test_a_holder_killed_with_sigkill_leaves_no_stale_lock(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
        with pytest.raises(FolderLocked) as refused:
            reopen(tmp_path)
        assert refused.value.pid == holder.pid
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
        holder.stdout.close()  # type: ignore[union-attr]
    assert (tmp_path / LOCK_FILE).read_text().split()[0] == str(holder.pid)  # never cleaned
    disk = reopen(tmp_path)  # the kernel dropped the dead process's lock
    assert (tmp_path / LOCK_FILE).read_text().split() == [str(os.getpid())]
    assert disk.save(list(range(30)), kv(30), "assistant") and disk.flush(10)
    assert len(entry_files(tmp_path)) == 1
    stop(disk)


def test_a_closing_holder_keeps_the_folder_until_its_last_write_ends(tmp_path, monkeypatch):
    release = held_disk_writer(monkeypatch)
    first = reopen(tmp_path)
    assert first.save(list(range(40)), kv(40), "assistant")
    assert not first.close(timeout=0)  # its write is still running: the folder is still held
    assert not first.save(list(range(100, 140)), kv(40), "assistant")  # closed: no new saves
    with pytest.raises(FolderLocked) as refused:
        reopen(tmp_path)  # no wait: refused at once, and told the holder is closing
    assert refused.value.closing
    opened: list[DiskPromptCache] = []
    waiter = threading.Thread(target=lambda: opened.append(reopen(tmp_path, lock_wait_s=30)))
    waiter.start()
    release.set()
    waiter.join(30)
    assert first.released
    (second,) = opened
    assert second.lookup(list(range(40)) + [1]) is not None  # the last write was kept
    stop(second)


# ---- the server's wiring -----------------------------------------------------------------


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return load_varied_model(tmp_path_factory)


def test_a_second_server_on_a_held_folder_runs_with_the_ram_tier_and_says_why(lm, tmp_path, capsys):
    from mlx_server.boot.disk_tier import disk_tier as _disk_tier
    from mlx_server.config import Settings

    model, _, path = lm
    loaded = SimpleNamespace(
        model=model, path=path, config=json.loads((path / "config.json").read_text())
    )
    settings = Settings(model=str(path), prompt_cache_dir=str(tmp_path))
    first, _ = _disk_tier(loaded, settings)
    assert first is not None
    disk, reason = _disk_tier(loaded, settings)
    assert disk is None
    assert str(first.directory) in reason and f"pid {os.getpid()}" in reason
    out = capsys.readouterr().out
    assert "Warning: prompt cache disk tier off" in out and str(first.directory) in out
    stats = PrefixCache(4, 1 << 30, disk_off_reason=reason).stats()
    assert stats["prompt_cache_disk"] == "off"
    assert stats["prompt_cache_disk_off_reason"] == reason
    on = PrefixCache(4, 1 << 30, disk=first).stats()
    assert on["prompt_cache_disk"] == "on"
    assert on["prompt_cache_disk_dir"] == str(first.directory)
    stop(first)


def test_a_release_during_the_closing_note_waits_for_it(tmp_path, monkeypatch):
    """``close`` marks the folder closing on the caller's thread while the writer thread may
    give the folder up: a release that comes in the middle of the note waits for it, and
    the note never writes to a closed file (a CI run once failed on that race)."""
    from mlx_server.engine.cache import folder_lock

    lock = folder_lock.FolderLock.acquire(tmp_path)
    real_truncate, releaser = os.ftruncate, []

    def truncate_then_race(fd: int, length: int) -> None:
        real_truncate(fd, length)
        t = threading.Thread(target=lock.release)
        t.start()
        releaser.append(t)
        t.join(0.5)  # with the guard, the release waits for the note to end
        assert t.is_alive() and lock.held

    monkeypatch.setattr(folder_lock.os, "ftruncate", truncate_then_race)
    lock.mark_closing()  # raised TypeError when the release closed the file mid-note
    releaser[0].join(10)
    assert not releaser[0].is_alive() and not lock.held
    assert (tmp_path / LOCK_FILE).read_text().split()[1] == "closing"
    lock.mark_closing()  # released: nothing to write, nothing raised
