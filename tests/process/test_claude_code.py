"""Claude Code in print mode against the real server.

Claude Code's first request carries a system prompt and 24 tool definitions, about 20,000
tokens, with a system message inside ``messages``, adaptive thinking, context management
and its beta headers. What is tested is that the whole exchange ends without an API error,
so the model is the demo model's tokenizer and chat template on tiny random weights: the
demo model itself needs over ten minutes on a 2-core CPU to prefill that prompt (the same
run passes on it; docs/benchmarks.md). ``.ci/run`` installs Claude Code with npm into
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

# The run itself may take up to an hour on a slow CPU (its subprocess timeout), after the
# server's start.
pytestmark = [pytest.mark.claude_code, pytest.mark.demo, pytest.mark.timeout(4200)]


@pytest.fixture(scope="module")
def tiny_smollm(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer and chat template on a 2-layer random-weight Llama whose answers
    are a few random tokens and then end-of-turn: random weights alone would never end, and
    Claude Code reports an answer cut at its max_tokens as an error."""
    import shutil

    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    src, path = demo_model_dir(), tmp_path_factory.mktemp("claude") / "tiny-smollm"
    path.mkdir()
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, path / f.name)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization", None)
    config.update(
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=65536,
        tie_word_embeddings=False,
    )
    (path / "config.json").write_text(json.dumps(config))
    mx.random.seed(0)
    net = llama.Model(llama.ModelArgs.from_dict(config))
    weights = {k: np.array(v) for k, v in tree_flatten(net.parameters())}
    # Hidden dimension 0 carries a large constant that the final norm alone lets through,
    # and only the end-of-turn token reads it: at temperature 1 each token ends the answer
    # with probability about 0.2, and every other token is equally likely.
    eos = config["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos
    weights["model.embed_tokens.weight"][:, 0] = 5.0
    weights["model.norm.weight"][:] = 0.0
    weights["model.norm.weight"][0] = 1.0
    head = np.zeros((config["vocab_size"], config["hidden_size"]), np.float32)
    head[eos, 0] = 1.2
    weights["lm_head.weight"] = head
    mx.save_safetensors(
        str(path / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()}
    )
    return path


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


def test_claude_code_print_mode_finishes_without_api_error(
    claude, tiny_smollm, server_factory, tmp_path
):
    port = free_port()
    args = ["-m", str(tiny_smollm), "--port", str(port), "--ctx-size", "65536"]
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
    assert result["is_error"] is False or result["subtype"] == "error_max_turns", result
    assert result["num_turns"] >= 1
    # The server saw Claude Code's requests, each with its tools, and logged no error.
    requests = [line for line in srv.lines if line.startswith("[mlx] Request: ")]
    assert requests and all("tools=0" not in line for line in requests), log
    print(result.get("subtype"), result.get("num_turns"), repr(result.get("result"))[:200])
    assert not [line for line in srv.lines if "Error" in line], log
