"""The Codex CLI (``@openai/codex``) completes two turns against the server's Responses API.

Codex runs non-interactively (``codex exec --json``) with a custom model provider on the
Responses wire API, in a temporary ``CODEX_HOME``. The model is the tiny random-weight one:
the answer's quality is not the point, the protocol is. Codex's own long system prompt is
replaced with a short one (``model_instructions_file``) and its hosted web search and
optional tool families are turned off, so the prompt stays small and every tool is a
function tool.

Install the CLI where this test looks for it (the npm package pulls its native binary from
an npm optional dependency; nothing is downloaded at postinstall):

    npm install --prefix .cache/npm @openai/codex
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from support import REPO, free_port, launch

# Two codex runs of up to 400 s each (their subprocess timeout), after the server's start.
pytestmark = [pytest.mark.codex, pytest.mark.timeout(1200)]

API_KEY = "sk-codex-test"


def codex_binary() -> str | None:
    local = REPO / ".cache" / "npm" / "node_modules" / ".bin" / "codex"
    if local.exists():
        return str(local)
    return os.environ.get("CODEX_BIN") or shutil.which("codex")


CODEX = codex_binary()

CONFIG = """\
model = "tiny"
model_provider = "mlx"
web_search = "disabled"
model_instructions_file = "{instructions}"

[features]
multi_agent = false
goals = false
skill_search = false
apps = false
plugins = false

[model_providers.mlx]
name = "mlx-server"
base_url = "{base_url}/v1"
env_key = "MLX_SERVER_KEY"
wire_api = "responses"
"""


def run_codex(args: list[str], work: Path, env: dict[str, str]) -> list[dict]:
    """Run ``codex exec`` with ``args``; its JSONL events (it must exit 0)."""
    assert CODEX is not None
    proc = subprocess.run(
        [CODEX, "exec", *args],
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-2000:])
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def assert_turn_completed(events: list[dict]) -> bool:
    """The turn completed without an error, and whatever text the model made reached Codex
    as an agent message; returns whether there was one. The tiny random-weight model samples
    at temperature 1 (Codex's requests leave it to the server), so now and then its first
    token is the end of its turn (an empty answer, one output token): no message then."""
    kinds = [e["type"] for e in events]
    assert "turn.completed" in kinds and "turn.failed" not in kinds and "error" not in kinds, kinds
    said = any(
        e["type"] == "item.completed" and e["item"]["type"] == "agent_message" for e in events
    )
    usage = next(e["usage"] for e in events if e["type"] == "turn.completed")
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    assert said or usage["output_tokens"] == 1, (kinds, usage)
    return said


def item_counts(lines: list[str]) -> list[int]:
    """The number of input items of each Responses request the server logged."""
    return [
        int(line.split("items=")[1].split(",")[0])
        for line in lines
        if "responses, items=" in line and "stream=true" in line
    ]


@pytest.mark.skipif(
    CODEX is None,
    reason="Codex CLI not installed (npm install --prefix .cache/npm @openai/codex)",
)
def test_codex_exec_completes_two_turns(tiny_model_dir: Path, tmp_path: Path):
    port = free_port()
    server = launch(
        ["-m", str(tiny_model_dir), "--port", str(port)]
        + ["--ctx-size", "16384", "--api-key", API_KEY]
    )
    try:
        assert server.wait_ready(120), server.lines
        home = tmp_path / "codex-home"
        work = tmp_path / "work"
        home.mkdir()
        work.mkdir()
        instructions = tmp_path / "instructions.md"
        instructions.write_text("You are a coding assistant. Answer briefly.\n")
        (home / "config.toml").write_text(
            CONFIG.format(instructions=instructions, base_url=server.base_url)
        )
        env = {
            **os.environ,
            "CODEX_HOME": str(home),
            "HOME": str(tmp_path),
            "MLX_SERVER_KEY": API_KEY,
        }
        first = run_codex(["--json", "--skip-git-repo-check", "Say hello."], work, env)
        said = assert_turn_completed(first)
        thread = next(e["thread_id"] for e in first if e["type"] == "thread.started")
        # The second turn sends the whole conversation back, the first answer included.
        second = run_codex(
            ["resume", "--json", "--skip-git-repo-check", thread, "Say goodbye."], work, env
        )
        assert_turn_completed(second)
    finally:
        server.stop()
    counts = item_counts(server.lines)
    # the new user message, and the first answer when there was one
    assert len(counts) == 2 and counts[1] >= counts[0] + 1 + said, server.lines
