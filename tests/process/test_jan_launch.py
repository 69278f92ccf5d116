"""The server launched exactly as Jan's launchers launch it (their argument lists, copied as
data from Jan's sources into data/jan/launchers.json), and with the flags of the Swift
server's earlier versions: every flag is accepted, ``--chat-template`` replaces the model's
template, the key also arrives as ``MLX_API_KEY``."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from support import free_port
from tiny_model import CHATML

from mlx_server.cli import parse_launch
from mlx_server.models.base import ModelLoadError
from mlx_server.models.template_override import install_chat_template, resolve_override

LAUNCHERS = json.loads((Path(__file__).parents[1] / "data" / "jan" / "launchers.json").read_text())
KEY = "q+3/Zx9vL0Q1rT7sB2mN8kP4wY6hJ5cV0aE1fG2dH3I="  # shaped like Jan's (base64 HMAC)
AUTH = {"Authorization": f"Bearer {KEY}"}

# A user's template in Jan's chat-template setting: plain text turns, nothing like ChatML.
USER_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)
MESSAGES = [{"role": "user", "content": "hello world"}]
AS_USER_TEMPLATE = "USER: hello world\nASSISTANT:"
AS_CHATML = "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"


def jan_command(launcher: dict, values: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """The launcher's arguments with every condition met, and its environment."""
    args = [a.format(**values) for g in launcher["groups"] for a in g["args"]]
    env = {k: v.format(**values) for k, v in launcher["env"].items()}
    return args, env


def token_count(srv, text: str, headers: dict[str, str]) -> int:
    r = httpx.post(srv.base_url + "/tokenize", json={"content": text}, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return len(r.json()["tokens"])


def prompt_tokens(srv, headers: dict[str, str]) -> int:
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 1, "temperature": 0}
    r = httpx.post(srv.base_url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_jan_launcher_with_chat_template_and_embedding(server_factory, tiny_model_dir):
    launcher = LAUNCHERS["launchers"][0]
    port = free_port()
    args, env = jan_command(
        launcher,
        {
            "model_path": str(tiny_model_dir / "model.safetensors"),  # Jan passes the file
            "port": str(port),
            "ctx_size": "2048",
            "api_key": KEY,
            "chat_template": USER_TEMPLATE,
        },
    )
    assert "--chat-template" in args and "--embedding" in args
    srv = server_factory(args, env=env)
    srv.wait_for_line("--embedding: this model generates text")
    n = token_count(srv, AS_USER_TEMPLATE, AUTH)
    assert n != token_count(srv, AS_CHATML, AUTH)
    assert prompt_tokens(srv, AUTH) == n  # the prompt was rendered with the user's template
    models = httpx.get(srv.base_url + "/v1/models", headers=AUTH, timeout=10).json()
    entry = models["data"][0]
    assert (entry["context_length"], entry["max_context_length"]) == (2048, 4096)
    assert entry["meta"]["n_ctx_train"] == 4096
    assert httpx.get(srv.base_url + "/v1/models", timeout=10).status_code == 401


def test_jan_launcher_with_model_id(server_factory, tiny_model_dir):
    launcher = LAUNCHERS["launchers"][1]
    args, env = jan_command(
        launcher,
        {
            "model_path": str(tiny_model_dir / "model.safetensors"),
            "port": str(free_port()),
            "model_id": "tiny-chat-1.5",
            "ctx_size": "4096",
            "api_key": KEY,
        },
    )
    srv = server_factory(args, env=env)
    models = httpx.get(srv.base_url + "/v1/models", headers=AUTH, timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["tiny-chat-1.5"]
    assert prompt_tokens(srv, AUTH) == token_count(srv, AS_CHATML, AUTH)  # the model's own
    assert httpx.get(srv.base_url + "/models", timeout=10).status_code == 401


def _cache_entries(srv) -> int:
    return httpx.get(srv.base_url + "/health", timeout=10).json()["prompt_cache_entries"]


def test_swift_batching_flags_and_the_key_only_as_MLX_API_KEY(server_factory, tiny_model_dir):
    flags = LAUNCHERS["swift_batching_flags"]["args"]
    args = ["--model", str(tiny_model_dir), "--port", str(free_port()), *flags]
    srv = server_factory(args, env={"MLX_API_KEY": KEY})
    for flag in ("--batch-timeout-ms", "--enable-continuous-batching", "--kv-block-size"):
        assert "no effect" in srv.wait_for_line(f"{flag} ")
    srv.wait_for_line("max batch size 1")  # --max-batch-size 0: one sequence at a time
    assert httpx.get(srv.base_url + "/v1/models", timeout=10).status_code == 401
    assert prompt_tokens(srv, AUTH) > 0
    deadline = time.monotonic() + 30  # the prefix cache (on) stores the finished sequence
    while _cache_entries(srv) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _cache_entries(srv) > 0


def test_prefix_caching_turned_off(server_factory, tiny_model_dir):
    args = ["-m", str(tiny_model_dir), "--port", str(free_port())]
    srv = server_factory([*args, "--enable-prefix-caching", "false"])
    srv.wait_for_line("--enable-prefix-caching false: prefix cache off")
    for _ in range(2):
        assert prompt_tokens(srv, {}) > 0
    health = httpx.get(srv.base_url + "/health", timeout=10).json()
    assert health["prompt_cache_entries"] == 0 and "prompt_cache_hits" not in health


def test_a_chat_template_that_does_not_parse_stops_the_start(server_factory, tiny_model_dir):
    broken = "{% for m in messages %}{{ m['content'] }"
    args = ["-m", str(tiny_model_dir), "--port", str(free_port()), "--chat-template", broken]
    srv = server_factory(args, wait=False)
    assert srv.wait_exit(120) == 1
    failed = [line for line in srv.lines if line.startswith("[mlx] Failed to load model: ")]
    assert failed and "--chat-template does not parse" in failed[0], srv.lines
    assert not any("http server listening" in line for line in srv.lines)


# ---- the flags' meanings, without a process --------------------------------------------


def test_readme_quick_start_flags_parse():
    values = {"model_path": "/m", "port": "8080"}
    args = [a.format(**values) for a in LAUNCHERS["swift_readme_quick_start"]["args"]]
    settings, notes = parse_launch(args, {})
    assert settings.max_batch_size == 8
    assert notes == ["--enable-continuous-batching true: no effect (batching is always continuous)"]


@pytest.mark.parametrize(
    ("flags", "cache_size"),
    [
        ([], 16),
        (["--enable-prefix-caching"], 16),
        (["--enable-prefix-caching", "true"], 16),
        (["--enable-prefix-caching=false"], 0),
        (["--enable-prefix-caching", "off"], 0),
    ],
)
def test_enable_prefix_caching_maps_onto_the_prefix_cache(flags, cache_size):
    settings, _ = parse_launch(["-m", "x", *flags], {})
    assert settings.prompt_cache_size == cache_size


@pytest.mark.parametrize(
    ("argv", "environ", "key"),
    [
        ([], {"MLX_API_KEY": "jan"}, "jan"),
        ([], {"MLX_API_KEY": "jan", "MLX_SERVER_API_KEY": "ours"}, "ours"),
        (["--api-key", "flag"], {"MLX_API_KEY": "jan"}, "flag"),
        ([], {}, ""),
    ],
)
def test_the_key_from_MLX_API_KEY_only_when_nothing_else_gives_one(argv, environ, key):
    assert parse_launch(["-m", "x", *argv], environ)[0].api_key == key


class _Wrapper:
    """What install_chat_template touches of mlx-lm's TokenizerWrapper."""

    def __init__(self) -> None:
        self._tokenizer = type("HF", (), {"chat_template": None})()
        self._chat_template: object = object()  # mlx-lm's own renderer, to be replaced
        self.has_chat_template = False


def test_chat_template_by_bundled_name_file_or_text(tmp_path):
    named = {"default": CHATML, "tool_use": "{{ 'TOOLS' }}{{ messages | length }}"}
    assert resolve_override("tool_use", named) == named["tool_use"]
    path = tmp_path / "mine.jinja"
    path.write_text(USER_TEMPLATE)
    assert resolve_override(str(path), CHATML) == USER_TEMPLATE
    assert resolve_override(USER_TEMPLATE, named) == USER_TEMPLATE
    tok = _Wrapper()
    install_chat_template(tok, named, "tool_use")
    assert tok._tokenizer.chat_template == named["tool_use"]
    assert tok._chat_template is None and tok.has_chat_template


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("no_such_name", "neither Jinja template text"),
        ("/nowhere/template.jinja", "cannot read"),
        ("{% if x %}unclosed", "does not parse"),
        ("{{ 1 + }}", "does not parse"),
    ],
)
def test_a_chat_template_that_names_nothing_or_does_not_parse_is_refused(value, needle):
    with pytest.raises(ModelLoadError) as e:
        resolve_override(value, {"default": CHATML, "tool_use": CHATML})
    assert needle in str(e.value)


def test_the_override_drives_tool_format_detection_and_the_probes(tiny_model_dir):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlx_server.models.base import read_chat_template
    from mlx_server.models.chat_template import ChatTemplate
    from mlx_server.parsing.tool_formats import detect_tool_parser

    llama_style = (
        "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{{ m['content'] }}<|eot_id|>{% endfor %}"
        "{% if tools %}Call tools as <|python_tag|>{...} (ipython).{% endif %}"
    )
    own = load_tokenizer(tiny_model_dir)
    assert detect_tool_parser(own) == "json_tools"  # ChatML with <tool_call>
    tok = load_tokenizer(tiny_model_dir)
    install_chat_template(tok, read_chat_template(tiny_model_dir), llama_style)
    assert detect_tool_parser(tok) == "llama3_json"
    probed = ChatTemplate.from_tokenizer(tok)
    assert probed is not None and probed.text == llama_style
    assert probed.render([{"role": "user", "content": "hi"}]).startswith("<|start_header_id|>user")
