"""A model loaded on one thread runs on another (the engine's): arrays its modules build while
loading, parameters or not, are evaluated by the loader (mlx-lm's Llama3RoPE keeps its
frequencies in ``_freqs``, outside ``parameters()``)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from arch_models import LLAMA3_ROPE
from tiny_model import build_tiny_model

pytestmark = pytest.mark.tiny


def _run_elsewhere(fn) -> list[BaseException]:
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    t = threading.Thread(target=target)
    t.start()
    t.join(60)
    assert not t.is_alive()
    return errors


def test_llama3_rope_model_runs_on_another_thread(tmp_path: Path) -> None:
    import mlx.core as mx

    from mlx_server.models.loader import load_model

    path = build_tiny_model(tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["rope_scaling"] = LLAMA3_ROPE
    (path / "config.json").write_text(json.dumps(config))
    loaded = load_model(str(path))

    errors = _run_elsewhere(lambda: mx.eval(loaded.model(mx.array([[1, 2, 3]]))))
    assert errors == []


def test_settle_arrays_finds_arrays_outside_the_parameters() -> None:
    import mlx.core as mx
    import mlx.nn as nn

    from mlx_server.models.base import settle_arrays

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(2, 2)
            self._hidden = mx.arange(4) * 2  # an item left out of parameters()
            self.lists = [mx.ones(2) + 1]

    holder = Holder()
    assert settle_arrays(holder) >= 2
    errors = _run_elsewhere(lambda: mx.eval(holder._hidden + 1, holder.lists[0] * 2))
    assert errors == []


def test_settle_arrays_finds_arrays_in_plain_objects() -> None:
    """Pixtral's vision tower keeps its rotary frequencies on a plain object (not a module):
    those are settled too, and objects that refer to each other are walked once."""
    import mlx.core as mx
    import mlx.nn as nn

    from mlx_server.models.base import settle_arrays

    class Rope:  # not an nn.Module
        def __init__(self) -> None:
            self.inv_freq = mx.arange(4) * 0.5
            self.me = self  # a cycle

    class Tower(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(2, 2)
            self.rope = Rope()

    tower = Tower()
    assert settle_arrays(tower) == 3  # the linear layer's weight and bias, and inv_freq
    errors = _run_elsewhere(lambda: mx.eval(tower.rope.inv_freq + 1))
    assert errors == []
