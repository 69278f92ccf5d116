"""Every tool-call and reasoning format, from real model outputs kept as data
(tests/data/formats/vectors.json, see its PROVENANCE.md): each text fed whole, character by
character and in three-character pieces gives the same, expected message."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mlx_server.parsing.detection import message_formats
from mlx_server.parsing.pipeline import OutputPipeline, collect
from mlx_server.parsing.tool_formats import available_tool_parsers, tool_format

VECTORS = json.loads(
    (Path(__file__).parents[1] / "data" / "formats" / "vectors.json").read_text(encoding="utf-8")
)


def _tools(case: dict[str, Any]) -> list[dict[str, Any]]:
    if "tools" in case:
        return [{"type": "function", "function": t} for t in case["tools"]]
    names = sorted({c["name"] for c in case["tool_calls"]} or {"special_function"})
    params = {"type": "object", "properties": {}}
    return [{"type": "function", "function": {"name": n, "parameters": params}} for n in names]


def _parse(case: dict[str, Any], pieces: list[str]) -> dict[str, Any]:
    messages = case["format"] if case["format"] in message_formats() else None
    ids = iter(f"call_{i}" for i in range(100))
    fmt = None if messages else tool_format(case["format"])
    pipeline = OutputPipeline(
        reasoning=tuple(case.get("reasoning_tags", ("<think>", "</think>"))),  # type: ignore[arg-type]
        start_in_reasoning=case.get("start_in_reasoning", False),
        tool_format=fmt,
        tools=_tools(case),
        id_factory=lambda: next(ids),
        message_format=messages,
        content_markers=fmt.content_markers if fmt else (),
    )
    events = [e for p in pieces for e in pipeline.feed(p)] + pipeline.flush()
    return collect(events)


def _split(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("case", VECTORS, ids=lambda c: c["id"])
def test_vector(case: dict[str, Any]):
    text = case["output"]
    whole = _parse(case, [text])
    assert _parse(case, list(text)) == whole
    assert _parse(case, _split(text, 3)) == whole
    assert whole["content"] == case["content"]
    assert whole["reasoning_content"] == case["reasoning_content"]
    got = [(c["name"], json.loads(c["arguments"])) for c in whole["tool_calls"]]
    assert got == [(c["name"], c["arguments"]) for c in case["tool_calls"]]


def test_every_format_has_vectors():
    covered = {c["format"] for c in VECTORS}
    expected = {
        "json_tools", "qwen3_coder", "mistral", "llama3_json", "pythonic", "deepseek",
        "glm47", "kimi_k2", "minimax_m2", "granite", "command_r7b", "nemotron_v2",
        "seed_oss", "phi4_mini", "firefunction_v2", "gemma4", "function_gemma", "harmony", "functionary_v3_2", "apertus", "command_r_plus",
        "functionary_v3_1",
    }  # fmt: skip
    assert expected <= covered
    assert covered - set(message_formats()) <= set(available_tool_parsers())
