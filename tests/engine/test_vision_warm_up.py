"""A batched vision model's warm-up: on CUDA every shape a request meets first costs it
seconds (a fresh H200 answered a text-only request to a Qwen2.5-VL 7B in 33.7 s, its text
twin, warmed, in 0.09 s), so the language model's shapes (batch sizes, prefill buckets)
are warmed as a text model's are. The warm-up runs on the model the batch runs, mlx-vlm's
language model behind mlx-lm's call (Qwen-VL's multimodal positions included); a model
whose requests run one at a time has none."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from tiny_vlm import build_tiny_idefics3, build_tiny_vlm

from mlx_server.engine.core.config import EngineConfig
from mlx_server.engine.core.tuning import WarmUp
from mlx_server.engine.runners.vision import VisionRunner, vision_runner
from mlx_server.engine.runners.vision_batch import VisionBatchRunner
from mlx_server.models.loader import load_model

WARM = EngineConfig(max_batch_size=3, prefill_step_size=64, warm_up=True, prefill_buckets=True)


@pytest.mark.parametrize(
    "build", [build_tiny_vlm, build_tiny_idefics3], ids=["qwen2_vl", "idefics3"]
)
def test_the_language_model_of_a_batched_vlm_warms_every_shape(build: Any, tmp_path: Path):
    loaded = load_model(str(build(tmp_path / "vlm")))
    setup = vision_runner(loaded.model, loaded.tokenizer, WARM)
    assert isinstance(setup.runner, VisionBatchRunner)
    assert setup.config.warm_up and setup.config.prefill_buckets
    plan = WarmUp(setup.model, 3, 64, float("inf"), buckets=True)
    secs = plan.before_ready()
    pieces = 0
    while plan.pending:  # batch sizes 2 and 3, then a full chunk in the batch
        secs += plan.step()
        pieces += 1
        assert pieces < 100, "the warm-up did not end"
    assert plan.pieces == pieces > 0 and secs > 0


def test_a_vlm_that_runs_one_request_at_a_time_has_no_warm_up(tmp_path: Path):
    loaded = load_model(str(build_tiny_vlm(tmp_path / "vlm")))
    # What batch_refusal answers for a family not checked to batch.
    loaded.model.config.model_type = "not-batched"
    setup = vision_runner(loaded.model, loaded.tokenizer, replace(WARM))
    assert isinstance(setup.runner, VisionRunner) and setup.serial_reason
    assert not setup.config.warm_up and not setup.config.prefill_buckets
