"""Shared fixtures: a tiny random-weight model, an in-process server over a scripted engine,
and a real ``mlx-server`` process."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

# Property tests draw the same examples on every run: a failure reproduces, it never flakes.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.load_profile("deterministic")

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS / "helpers"))

from support import (  # noqa: E402
    InProcessServer,
    ServerProcess,
    demo_model_dir,
    launch,
    serving,
    start_in_process,
)
from tiny_model import build_tiny_model  # noqa: E402

# Servers and engines started by tests keep their prefix cache's disk tier here, never in the
# user's cache directory (tests that check the disk tier pass --prompt-cache-dir themselves).
_PROMPT_CACHE_ROOT = tempfile.mkdtemp(prefix="mlx-server-test-prompt-cache-")
os.environ["MLX_SERVER_PROMPT_CACHE_DIR"] = _PROMPT_CACHE_ROOT
atexit.register(shutil.rmtree, _PROMPT_CACHE_ROOT, True)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-model")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture
def scripted(tiny_tokenizer) -> Iterator[InProcessServer]:
    srv = start_in_process(tiny_tokenizer)
    yield srv
    srv.stop()


@pytest.fixture
def scripted_factory(tiny_tokenizer):
    servers: list[InProcessServer] = []

    def make(**kw) -> InProcessServer:
        srv = start_in_process(tiny_tokenizer, **kw)
        servers.append(srv)
        return srv

    yield make
    for s in servers:
        s.stop()


@pytest.fixture
def server_factory():
    procs: list[ServerProcess] = []

    def make(
        args: list[str], *, wait: bool = True, env: dict[str, str] | None = None
    ) -> ServerProcess:
        sp = launch(args, env)
        procs.append(sp)
        if wait:
            assert sp.wait_ready(), f"server did not become ready: {sp.lines} {sp.stderr_text()}"
        return sp

    yield make
    for p in procs:
        p.stop()


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory) -> Iterator[ServerProcess]:
    """One real server process on the tiny model, shared by the session's tests."""
    model = build_tiny_model(tmp_path_factory.mktemp("srv") / "tiny-model")
    with serving(["-m", str(model), "--ctx-size", "256"]) as sp:
        yield sp


@pytest.fixture(scope="session")
def demo_server() -> Iterator[ServerProcess]:
    """One demo-model server for the session, shared by the modules whose demo tests need no
    setting of their own (each started its own before, several seconds apiece); a module that
    needs other flags starts its own."""
    with serving(["-m", str(demo_model_dir()), "--ctx-size", "2048"]) as sp:
        yield sp


@pytest.fixture(scope="module", params=["tiny", pytest.param("demo", marks=pytest.mark.demo)])
def e2e_server(request) -> Iterator[ServerProcess]:
    """A real server process, once on the tiny random model and once on the demo model."""
    if request.param == "tiny":
        yield request.getfixturevalue("tiny_server")  # the same flags: the session's
        return
    with serving(["-m", str(demo_model_dir()), "--ctx-size", "256"]) as sp:
        yield sp


SCRIPTED_FIXTURES = {"scripted", "scripted_factory"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test's tier as a marker: ``demo`` (needs the demo model; set where it is used),
    ``scripted`` (the real server stack over the scripted engine), or ``tiny`` (real engines
    and servers on tiny models the tests build, and unit tests). ``pytest -m scripted`` runs
    the protocol tests alone in well under a minute."""
    stray = sorted({path.name for i in items if (path := Path(str(i.fspath))).parent == TESTS})
    if stray:
        raise pytest.UsageError(
            f"{', '.join(stray)}: a test file goes in the folder of its tier (tests/unit, "
            "tests/engine, tests/server or tests/process; tests/README.md says which)"
        )
    for item in items:
        if item.get_closest_marker("demo"):
            continue
        names = set(getattr(item, "fixturenames", ()))
        scripted = names & SCRIPTED_FIXTURES or item.module.__name__.endswith("_scripted")
        item.add_marker(pytest.mark.scripted if scripted else pytest.mark.tiny)
    # The longest files first (stable: a file's own order is kept), so that the two xdist
    # workers (scripts/test.sh) do not end with one of them alone on a long file.
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))


# Files that take a minute or more on a 2-core machine (pytest --durations), longest first.
LONGEST_FILES = (
    "test_sharded.py",
    "test_speculative.py",
    "test_replicas.py",
    "test_arch_matrix.py",
    "test_gpu_kit.py",
    "test_speculative_batch_engine.py",
    "test_models_process.py",
    "test_arch_kv_bits.py",
    "test_arch_prefix_cache.py",
    "test_arch_speculative.py",
    "test_rerank_models.py",
    "test_structured_demo.py",
    "test_claude_code.py",
    "test_n_choices.py",
    "test_arch_speculative_http.py",
    "test_fuzz.py",
    "test_disk_cache_server.py",
    "test_codex_cli.py",
)


@pytest.fixture(scope="session")
def arch_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny model of every architecture family (tests/helpers/arch_models.py), by family name; a
    matrix row parametrizes over ``arch_models.FAMILIES`` and takes its directory here."""
    from arch_models import build_all

    return build_all(tmp_path_factory.mktemp("arch"))
