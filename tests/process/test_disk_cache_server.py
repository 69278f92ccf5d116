"""The disk tier with the real server process: a restart serves a long prompt from disk,
``kill -9`` during writes leaves a directory the next start cleans and serves from, a
corrupt entry is deleted and logged, never used, and a second server on the same directory
leaves it to the first."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import zlib
from pathlib import Path

import httpx
import pytest
from support import build_wide_model, free_port

from mlx_server.engine.cache.disk import MANIFEST

SYSTEM = "You are a terse assistant who answers questions about the capital of France. " * 25


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> Path:
    return build_wide_model(tmp_path_factory.mktemp("wide") / "tiny-wide")


def chat(srv, user: str, system: str = SYSTEM, max_tokens: int = 4) -> dict:
    r = httpx.post(
        srv.base_url + "/v1/chat/completions",
        json={
            "model": "m",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r.json()


def health(srv) -> dict:
    return httpx.get(srv.base_url + "/health", timeout=10).json()


def model_dirs(root: Path) -> list[Path]:
    return [d for d in root.iterdir() if d.is_dir()]


def args(model: Path, root: Path, port: int, *extra: str) -> list[str]:
    return [
        "-m", str(model), "--port", str(port), "--ctx-size", "4096",
        "--prompt-cache-dir", str(root), *extra,
    ]  # fmt: skip


def test_a_restarted_server_serves_the_long_prompt_from_disk(server_factory, wide_model, tmp_path):
    port = free_port()
    first = server_factory(args(wide_model, tmp_path, port))
    cold = chat(first, "What is the capital of France?")
    assert cold["usage"]["prompt_tokens"] > 300
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    first.stop()  # SIGTERM: what RAM holds is written before exit
    assert first.proc.returncode is not None
    second = server_factory(args(wide_model, tmp_path, port))
    warm = chat(second, "What is the capital of France?")
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
    assert (
        warm["usage"]["prompt_tokens_details"]["cached_tokens"]
        == cold["usage"]["prompt_tokens"] - 1
    )
    h = health(second)
    assert h["prompt_cache_disk_hits"] == 1 and h["prompt_cache_disk_read_bytes"] > 0
    assert h["prompt_cache_disk_entries"] >= 1
    # A different question still reuses the system prompt written at its first prefill.
    other = chat(second, "Name a river.")
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] > 300


def _entries_are_intact(d: Path) -> dict:
    path = d / MANIFEST
    manifest = json.loads(path.read_text())["entries"] if path.exists() else {}
    for name, e in manifest.items():
        data = (d / f"{name}.safetensors").read_bytes()
        assert len(data) == e["bytes"] and zlib.crc32(data) == e["crc"], name
    return manifest


def test_kill_9_during_writes_then_restart_serves_and_never_uses_a_bad_entry(
    server_factory, wide_model, tmp_path
):
    port = free_port()
    # One RAM entry: each new conversation evicts the previous one to disk.
    flags = ("--prompt-cache-size", "1")
    srv = server_factory(args(wide_model, tmp_path, port, *flags))
    stop = threading.Event()

    def load() -> None:
        i, deadline = 0, time.monotonic() + 300
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                chat(srv, f"Question number {i}?", system=f"Session {i}. " + SYSTEM)
            except (httpx.HTTPError, AssertionError):
                return  # the server was killed
            i += 1

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    (cache_dir,) = _wait_for(lambda: model_dirs(tmp_path) or None, 120)
    # Kill the moment a write is in flight (a temporary file exists).
    _wait_for(lambda: any(f.name.startswith(".tmp-") for f in cache_dir.iterdir()), 120)
    os.kill(srv.proc.pid, signal.SIGKILL)
    srv.proc.wait(10)
    stop.set()
    worker.join(30)

    again = server_factory(args(wide_model, tmp_path, port, *flags))
    assert not [f for f in cache_dir.iterdir() if f.name.startswith(".tmp-")]
    listed = set(_entries_are_intact(cache_dir))
    assert {f.stem for f in cache_dir.glob("*.safetensors")} == listed
    for i in range(3):
        chat(again, f"Question number {i}?", system=f"Session {i}. " + SYSTEM)
    assert health(again)["prompt_cache_disk_corrupt"] == 0
    again.stop()
    assert len(_entries_are_intact(cache_dir)) >= 2


def test_a_corrupt_entry_is_deleted_logged_and_not_used(server_factory, wide_model, tmp_path):
    port = free_port()
    first = server_factory(args(wide_model, tmp_path, port))
    cold = chat(first, "What is the capital of France?")
    first.stop()
    (cache_dir,) = model_dirs(tmp_path)
    entries = list(cache_dir.glob("*.safetensors"))
    assert len(entries) == 2  # the system prompt and the conversation
    for f in entries:  # same size, other bytes: only the checksum can tell
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    second = server_factory(args(wide_model, tmp_path, port))
    warm = chat(second, "What is the capital of France?")
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
    h = health(second)
    assert h["prompt_cache_disk_corrupt"] == 2 and h["prompt_cache_disk_hits"] == 0
    assert sum("dropping unreadable entry" in line for line in second.lines) == 2
    second.stop()  # the same prompts were stored again: fresh, intact files
    assert set(_entries_are_intact(cache_dir)) == {f.stem for f in entries}


def test_a_second_server_on_the_same_folder_serves_without_touching_it(
    server_factory, wide_model, tmp_path
):
    first = server_factory(args(wide_model, tmp_path, free_port()))
    chat(first, "What is the capital of France?")  # its system prompt is written at once
    (cache_dir,) = model_dirs(tmp_path)
    written = _wait_for(lambda: _entries_are_intact(cache_dir), 60)
    in_flight = cache_dir / ".tmp-0123-4-5.safetensors"  # as if the first were writing it
    in_flight.write_bytes(b"half a file")
    second = server_factory(args(wide_model, tmp_path, free_port()))
    cold = chat(second, "What is the capital of France?")
    warm = chat(second, "What is the capital of France?")
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 300  # its RAM tier
    h = health(second)
    assert h["prompt_cache_disk"] == "off" and "prompt_cache_disk_entries" not in h
    reason = h["prompt_cache_disk_off_reason"]
    assert str(cache_dir) in reason and f"pid {first.proc.pid}" in reason
    assert any("Warning: prompt cache disk tier off" in line for line in second.lines)
    assert health(first)["prompt_cache_disk"] == "on"
    assert in_flight.read_bytes() == b"half a file"
    assert written.items() <= _entries_are_intact(cache_dir).items()
    second.stop()
    first.stop()
    assert len(_entries_are_intact(cache_dir)) >= 2  # the first wrote the rest at its exit


def _wait_for(cond, timeout: float):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.002)
    raise AssertionError("condition not reached in time")
