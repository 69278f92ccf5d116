"""Claude Code in print mode against the real server on the demo model.

Claude Code's first request carries a system prompt and 24 tool definitions, about 20,000
tokens, with a system message inside ``messages``, adaptive thinking, context management
and its beta headers. The tiny demo model's answer is noise; what is tested is that the
whole exchange ends without an API error. ``.ci/run`` installs Claude Code with npm into
``.cache/npm`` (git-ignored); without it this test is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from support import REPO, demo_model_dir, free_port

CLAUDE = REPO / ".cache" / "npm" / "node_modules" / ".bin" / "claude"

pytestmark = [pytest.mark.claude_code, pytest.mark.demo]


@pytest.fixture(scope="module")
def claude() -> Path:
    if not CLAUDE.exists():
        pytest.skip(
            f"Claude Code is not installed at {CLAUDE.relative_to(REPO)}: "
            "npm install --prefix .cache/npm @anthropic-ai/claude-code (as .ci/run does)"
        )
    return CLAUDE


def claude_env(home: Path, base_url: str) -> dict[str, str]:
    """Only the local server is reached: no telemetry, updates or other traffic."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_AUTH_TOKEN": "sk-local",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        # A small model answers in a few hundred tokens; Claude Code would ask for 64,000.
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "128",
        # On a slow CPU the first prefill can outlast Claude Code's 5-minute stream-idle
        # watchdog (pings do not count) and its request timeout.
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS": "3600000",
        "API_TIMEOUT_MS": "3600000",
        # An error from the server ends the run at once instead of being retried.
        "CLAUDE_CODE_MAX_RETRIES": "0",
    }


def test_claude_code_print_mode_finishes_without_api_error(claude, server_factory, tmp_path):
    port = free_port()
    args = ["-m", str(demo_model_dir()), "--port", str(port), "--ctx-size", "65536"]
    srv = server_factory(args, wait=False)
    assert srv.wait_ready(300), srv.lines
    project = tmp_path / "project"
    project.mkdir()
    (project / "hello.py").write_text("print('hello from hello.py')\n")
    home = tmp_path / "home"
    home.mkdir()

    proc = subprocess.run(
        # Two turns bound the run: a random-ish small model may keep calling tools.
        [str(claude), "-p", "What does hello.py print?", "--output-format", "json"]
        + ["--max-turns", "2"],
        cwd=project,
        env=claude_env(home, srv.base_url),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    output = proc.stdout + proc.stderr
    log = "\n".join(srv.lines)
    assert "API Error" not in output, f"{output}\n--- server log ---\n{log}"
    result = json.loads(proc.stdout)
    # It answered, or it was still using its tools when the turn limit ended the run.
    assert result["type"] == "result", result
    assert result["subtype"] in ("success", "error_max_turns"), result
    assert proc.returncode == 0 or result["subtype"] == "error_max_turns", output
    assert result.get("api_error_status") is None, result
    assert result["num_turns"] >= 1
    # The server saw Claude Code's requests, each with its tools, and logged no error.
    requests = [line for line in srv.lines if line.startswith("[mlx] Request: ")]
    assert requests and all("tools=0" not in line for line in requests), log
    assert not [line for line in srv.lines if "Error" in line], log
