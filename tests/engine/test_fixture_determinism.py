"""Every tiny model and tokenizer the tests build is the same on every run: two builds, in two
processes with different hash seeds, write identical files (tokenizer.json, weights, configs).
A builder whose output changes between runs makes a test's inputs change, and its reference
comparisons flaky (the unigram tokenizer trainer did: its vocabulary changed on every run)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parents[1] / "helpers"


def _builders() -> dict[str, Callable[[Path], Any]]:
    """Each builder by name, called with a destination it creates."""
    from conftest_gguf import write_tiny_gguf
    from embedding_support import (
        build_tiny_bert_embedder,
        build_tiny_cross_encoder,
        build_tiny_qwen3_embedder,
        build_tiny_qwen3_reranker,
        build_tiny_xlmr_cross_encoder,
    )
    from engine_runner import build_varied_model
    from support import build_wide_model
    from tiny_model import build_tiny_model, build_tokenizer
    from tiny_vlm import build_tiny_idefics3, build_tiny_vlm

    def spm_tokenizer(dest: Path) -> None:
        dest.mkdir(parents=True)
        build_tokenizer(dest, spm=True)

    def gguf(dest: Path) -> None:
        dest.mkdir(parents=True)
        write_tiny_gguf(dest / "tiny.gguf", "llama")

    return {
        "tiny_model": build_tiny_model,
        "spm_tokenizer": spm_tokenizer,
        "varied_model": build_varied_model,
        "wide_model": lambda d: build_wide_model(d, layers=2),
        "tiny_vlm": build_tiny_vlm,
        "tiny_idefics3": build_tiny_idefics3,
        "gguf": gguf,
        "bert_cross_encoder": build_tiny_cross_encoder,
        "xlmr_cross_encoder": build_tiny_xlmr_cross_encoder,
        "qwen3_embedder": build_tiny_qwen3_embedder,
        "qwen3_reranker": build_tiny_qwen3_reranker,
        "bert_embedder": build_tiny_bert_embedder,
    }


def _digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _build_all_in_a_process(out: Path, hash_seed: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    return subprocess.Popen(
        [sys.executable, __file__, str(out)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _build_all(out: Path) -> None:
    for name, build in _builders().items():
        build(out / name)


@pytest.mark.timeout(480)  # two builds of every fixture (torch, transformers): minutes on 2 cores
def test_every_builder_writes_the_same_files_twice(tmp_path: Path) -> None:
    runs = [tmp_path / "a", tmp_path / "b"]
    # One build in a process of its own (another hash seed, fresh native state), the other
    # here meanwhile.
    proc = _build_all_in_a_process(runs[0], "1")
    try:
        _build_all(runs[1])
        output, _ = proc.communicate(timeout=420)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, output
    names = sorted(p.name for p in runs[0].iterdir())
    assert names == sorted(_builders()), names
    for name in names:
        first, second = _digests(runs[0] / name), _digests(runs[1] / name)
        assert first, f"{name} wrote nothing"
        differing = sorted(k for k in first.keys() | second.keys() if first.get(k) != second.get(k))
        assert not differing, f"{name}: files differ between two builds: {differing}"


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    _build_all(Path(sys.argv[1]))
