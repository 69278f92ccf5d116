"""The seams between layers: every engine is an EngineLike, and the layers import only
what the design lets them import."""

from __future__ import annotations

import ast
from pathlib import Path

from engine_runner import load_varied_model
from scripted_engine import ScriptedEngine

from mlx_server.engine.engine import Engine, EngineConfig
from mlx_server.engine.protocol import EngineLike, engine_stats

SRC = Path(__file__).resolve().parents[1] / "src" / "mlx_server"


def test_every_engine_is_engine_like(tmp_path_factory):
    from mlx_server.engine.embedding_engine import EmbeddingEngine
    from mlx_server.engine.vision_engine import VisionEngine
    from mlx_server.registry.catalog import Offer
    from mlx_server.registry.registry import Limits, ModelRegistry
    from mlx_server.registry.routing import RoutedEngine
    from mlx_server.server.metrics import InstrumentedEngine, Metrics

    model, tokenizer, _ = load_varied_model(tmp_path_factory)
    scripted = ScriptedEngine()
    registry = ModelRegistry([Offer("m", "/m", "chat", 0)], Limits(0, 0, 0.0, 0, 0), print)
    for engine in (
        Engine(model, tokenizer, EngineConfig()),
        VisionEngine(model, tokenizer, EngineConfig()),
        EmbeddingEngine(runner=None),
        RoutedEngine(registry),
        InstrumentedEngine(scripted, Metrics(scripted)),
        scripted,
    ):
        assert isinstance(engine, EngineLike), type(engine)
        stats = engine_stats(engine)
        assert stats["active"] == 0 and stats["queued"] == 0
        # Each kind declares the protocol's methods itself (not through __getattr__).
        declared = {n for c in type(engine).__mro__ for n in vars(c)}
        assert {"call", "stats", "submit", "cancel", "start", "shutdown"} <= declared


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_layers_import_only_downwards():
    """engine/, models/ and parsing/ know nothing of protocols or the server; the protocols
    never import each other."""
    protocols = sorted(p.name for p in (SRC / "protocols").iterdir() if p.is_dir())
    assert {"openai", "anthropic"} <= set(protocols)
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).parts
        mods = imports_of(path)
        if rel[0] in ("engine", "models", "parsing"):
            bad = {m for m in mods if m.startswith(("mlx_server.protocols", "mlx_server.server"))}
            assert not bad, (path, bad)
        if rel[0] == "protocols" and len(rel) > 2:
            others = [p for p in protocols if p != rel[1] and not p.startswith("_")]
            bad = {
                m for m in mods if any(m.startswith(f"mlx_server.protocols.{o}") for o in others)
            }
            assert not bad, (path, bad)


# What server/ (plumbing: SSE, the stream driver, auth, browser guard, metrics, serving)
# may not import: the protocols use it, and the app factory outside it wires them onto it.
ABOVE_THE_SERVER = (
    "mlx_server.protocols",
    "mlx_server.service",
    "mlx_server.app",
    "mlx_server.wiring",
)


def test_the_server_is_plumbing_the_protocols_use():
    files = sorted((SRC / "server").rglob("*.py"))
    assert {"streaming.py", "sse.py", "errors.py"} <= {p.name for p in files}
    for path in files:
        bad = {m for m in imports_of(path) if m.startswith(ABOVE_THE_SERVER)}
        assert not bad, (path, bad)
    # ... and the protocols do use it: every generating route ends through its driver.
    for proto in ("openai", "anthropic", "responses"):
        mods = set().union(*(imports_of(p) for p in (SRC / "protocols" / proto).glob("*.py")))
        assert "mlx_server.server.streaming" in mods, proto


def test_the_services_submit_through_one_path():
    """Chat and text completion reach the engine only through service/generation.submit."""
    for name in ("chat.py", "text_completion.py"):
        text = (SRC / "service" / name).read_text()
        assert "engine.submit(" not in text and "submit(" in text, name
        assert "ChatRequest(" not in text, name  # no stand-in request to reach a check


def test_the_vision_loader_does_not_import_the_text_loader():
    """Both import the shared model types; the text loader picks the vision one lazily."""
    assert "mlx_server.models.loader" not in imports_of(SRC / "models" / "vision.py")
    assert "mlx_server.models.base" in imports_of(SRC / "models" / "vision.py")


def test_every_protocol_translates_every_finish_reason():
    """Finish reasons are one Literal; each protocol's table covers all of them, and a
    reason outside it is refused where it enters (the engine's text from mlx-lm)."""
    from typing import get_args

    import pytest

    from mlx_server.events import Finished, FinishReason, Usage, finish_reason
    from mlx_server.protocols.anthropic.encoder import STOP_REASONS, stop_reason
    from mlx_server.protocols.openai.encoder import FINISH_REASONS
    from mlx_server.protocols.openai.encoder import finish_reason as openai_finish

    reasons = set(get_args(FinishReason))
    assert set(FINISH_REASONS) == reasons and set(STOP_REASONS) == reasons
    assert finish_reason("length") == "length"
    with pytest.raises(ValueError):
        finish_reason("eos")
    stop_in_reasoning = Finished("stop", Usage(1, 1), in_reasoning=True)
    assert openai_finish(stop_in_reasoning) == "length"  # the answer never came
    assert stop_reason(stop_in_reasoning) == "end_turn"
    assert openai_finish(Finished("stop_sequence", Usage(1, 1))) == "stop"
