"""The seams between layers: every engine is an OwnedEngine (the generating ones EngineLike), and the layers import only
what the design lets them import."""

from __future__ import annotations

import ast
from pathlib import Path

from engine_runner import load_varied_model, text_engine, vision_engine
from scripted_engine import ScriptedEngine

from mlx_server.engine.core.engine import EngineConfig
from mlx_server.engine.core.protocol import (
    ChatEngine,
    EngineCounters,
    EngineLike,
    OwnedEngine,
    engine_stats,
)

SRC = Path(__file__).resolve().parents[2] / "src" / "mlx_server"


def test_every_engine_is_engine_like(tmp_path_factory):
    from mlx_server.engine.embedding.engine import EmbeddingEngine
    from mlx_server.registry.catalog import Offer
    from mlx_server.registry.lease import LoadedEngines, RegistryModels
    from mlx_server.registry.registry import Limits, ModelRegistry

    model, tokenizer, _ = load_varied_model(tmp_path_factory)
    scripted = ScriptedEngine()
    generating = (
        text_engine(model, tokenizer, EngineConfig()),
        vision_engine(model, tokenizer, EngineConfig()),
        scripted,
    )
    for engine in (*generating, EmbeddingEngine(runner=None)):
        assert isinstance(engine, OwnedEngine), type(engine)
        assert isinstance(engine, EngineLike) == (engine in generating), type(engine)
        stats = engine_stats(engine)
        assert stats["active"] == 0 and stats["queued"] == 0
        # Each kind declares the protocol's methods itself (not through __getattr__).
        declared = {n for c in type(engine).__mro__ for n in vars(c)}
        assert {"call", "stats", "cancel", "start", "shutdown"} <= declared
        assert ("submit" in declared) == (engine in generating)
    # A registry's models are counted as one for monitoring; no engine stands for them.
    registry = ModelRegistry([Offer("m", "/m", "chat", 0)], Limits(0, 0, 0.0, 0, 0), print)
    loaded = LoadedEngines(RegistryModels(registry, 256))
    assert isinstance(loaded, EngineCounters) and not isinstance(loaded, EngineLike)
    assert engine_stats(loaded) == {"active": 0, "queued": 0}
    # The engines the chat service generates on announce requests (no getattr probing).
    for engine in (text_engine(model, tokenizer, EngineConfig()), scripted):
        assert isinstance(engine, ChatEngine), type(engine)


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
ABOVE_THE_SERVER = ("mlx_server.protocols", "mlx_server.service", "mlx_server.boot")


def test_the_server_is_plumbing_the_protocols_use():
    files = sorted((SRC / "server").rglob("*.py"))
    assert {"streaming.py", "sse.py", "errors.py"} <= {p.name for p in files}
    for path in files:
        bad = {m for m in imports_of(path) if m.startswith(ABOVE_THE_SERVER)}
        assert not bad, (path, bad)
    # ... and the protocols do use it: every generating route ends through its driver.
    for proto in ("openai", "anthropic", "responses"):
        mods = set().union(*(imports_of(p) for p in (SRC / "protocols" / proto).rglob("*.py")))
        assert "mlx_server.server.streaming" in mods, proto


def test_model_routes_open_through_one_helper():
    """Every route that serves a model leases it through server/http.parse_and_lease (the
    body parsed, the model it names leased with its keep_alive), not by calling the lease."""
    users = set()
    for path in [*(SRC / "protocols").rglob("*.py"), SRC / "server" / "collect.py"]:
        text = path.read_text()
        assert "models.chat(request" not in text and "models.encoder(request" not in text, path
        if "parse_and_lease(" in text:
            users.add(path.relative_to(SRC).as_posix())
    assert {
        "protocols/openai/chat/routes.py",
        "protocols/anthropic/routes.py",
        "protocols/ollama/routes.py",
        "server/collect.py",
    } <= users


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
    from mlx_server.protocols.anthropic.stream import STOP_REASONS, stop_reason
    from mlx_server.protocols.openai.finish import FINISH_REASONS
    from mlx_server.protocols.openai.finish import finish_reason as openai_finish

    reasons = set(get_args(FinishReason))
    assert set(FINISH_REASONS) == reasons and set(STOP_REASONS) == reasons
    assert finish_reason("length") == "length"
    with pytest.raises(ValueError):
        finish_reason("eos")
    stop_in_reasoning = Finished("stop", Usage(1, 1), in_reasoning=True)
    assert openai_finish(stop_in_reasoning) == "length"  # the answer never came
    assert stop_reason(stop_in_reasoning) == "end_turn"
    assert openai_finish(Finished("stop_sequence", Usage(1, 1))) == "stop"


def module_name(path: Path) -> str:
    parts = ("mlx_server", *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Every module of the package and the package modules it imports, at any depth of the
    file (imports inside functions count: they close a cycle all the same). ``from pkg
    import name`` counts as importing ``pkg.name`` when that is a module."""
    modules = {module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, one level up per extra dot
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                for alias in node.names:
                    edges.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
            elif isinstance(node, ast.Import):
                edges.update(a.name for a in node.names)
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules in order, the first repeated at the end), or None."""
    done: set[str] = set()
    for root in sorted(graph):
        path: list[str] = []
        on_path: set[str] = set()
        stack = [(root, iter(sorted(graph[root])))] if root not in done else []
        if stack:
            path.append(root)
            on_path.add(root)
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                on_path.discard(node)
                done.add(node)
            elif child in on_path:
                return [*path[path.index(child) :], child]
            elif child not in done:
                stack.append((child, iter(sorted(graph[child]))))
                path.append(child)
                on_path.add(child)
    return None


def test_the_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a2"}, "a2": set(), "b": {"b"}}) == ["b", "b"]


def test_no_import_cycle_counting_imports_inside_functions():
    graph = import_graph()
    assert "mlx_server.boot.start" in graph["mlx_server.cli"]  # the graph sees function imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_start_up_is_imported_only_by_the_command_line():
    for name, imports in import_graph().items():
        if not name.startswith("mlx_server.boot") and name not in (
            "mlx_server.cli",
            "mlx_server.__main__",
        ):
            bad = {m for m in imports if m.startswith("mlx_server.boot")}
            assert not bad, (name, bad)


def test_the_services_know_no_protocol_no_server_and_no_start_up():
    above = ("mlx_server.protocols", "mlx_server.server", "mlx_server.boot")
    for path in (SRC / "service").rglob("*.py"):
        bad = {m for m in imports_of(path) if m.startswith(above)}
        assert not bad, (path, bad)


# The package's root modules: the entry points, settings, and the vocabulary every layer
# shares. Anything else belongs in a folder that says what it is for.
ROOT_MODULES = {
    "__init__",
    "__main__",
    "cli",
    "config",
    "embedding_service",
    "errors",
    "events",
    "legacy_flags",
    "logs",
    "request_checks",
    "startup_report",
    "types",
}


def test_root_modules_stay_few():
    assert {p.stem for p in SRC.glob("*.py")} <= ROOT_MODULES


def test_the_engine_core_builds_no_runner():
    """Runners are start-up's to build (runners/assembly, speculative/assembly,
    runners/vision) and the engine's to run: engine/core knows only their interface."""
    graph = import_graph()
    for name, imports in graph.items():
        if name.startswith("mlx_server.engine.core"):
            bad = {
                m
                for m in imports
                if m.startswith(("mlx_server.engine.runners", "mlx_server.engine.speculative"))
                and m != "mlx_server.engine.runners.base"
            }
            assert not bad, (name, bad)
    builders = {"mlx_server.engine.runners.assembly", "mlx_server.engine.speculative.assembly"}
    assert builders <= graph["mlx_server.boot.chat"]
