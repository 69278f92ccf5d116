"""Settings: every option bounded and checked at start (exit 2 with the reason), and each
one settable from its MLX_SERVER_<NAME> environment variable, the flag winning."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mlx_server.cli import parse_settings
from mlx_server.config import settings_fields


def fails(capsys, argv, environ=None) -> str:
    with pytest.raises(SystemExit) as e:
        parse_settings(argv, environ or {})
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--max-batch-size", "-1"),
        ("--ctx-size", "0"),
        ("--ctx-size", "-5"),
        ("--prefill-step-size", "0"),
        ("--port", "70000"),
        ("--max-queue", "-1"),
        ("--kv-budget-gb", "0"),
        ("--prompt-cache-size", "-1"),
        ("--max-image-mb", "0"),
    ],
)
def test_out_of_range_values_exit_2_naming_the_flag(capsys, flag, value):
    err = fails(capsys, ["-m", "x", flag, value])
    assert flag in err and value.lstrip("-") in err


def _sample(f) -> tuple[str, object]:
    """A valid value for option ``f``, other than its default: (as text, as parsed)."""
    meta = f.metadata
    if f.name == "tool_call_parser":  # checked against the known formats
        return "json_tools", "json_tools"
    if f.name == "draft_kind":  # checked against the drafters built
        return "ngram", "ngram"
    if f.type in ("bool", bool):
        return "true", True
    if "choices" in meta:
        choice = meta["choices"][-1]
        return str(choice), choice
    if "float" in str(f.type):
        return "3.5", 3.5
    if "int" in str(f.type):
        low = max(meta.get("min", 1), 1)
        value = min(low + 2, meta.get("max", low + 2))
        return str(value), value
    return "some-value", "some-value"


def _env_names_in_help(help_text: str) -> dict[str, str]:
    """{long flag: the variable its help names}, read from ``--help``."""
    import re

    flat = " ".join(help_text.split())
    found = {}
    for m in re.finditer(r"(--[a-z][a-z0-9-]*)(?:(?!--[a-z]).)*?\[env: ([A-Z0-9_]+)\]", flat):
        found[m.group(1)] = m.group(2)
    return found


def test_every_option_can_be_set_from_the_variable_its_help_names(capsys):
    """What ``--help`` promises holds: each option's ``[env: NAME]`` variable sets it."""
    named = _env_names_in_help(_help(capsys))
    for f in settings_fields():
        flag = f.metadata["flags"][-1]
        assert flag in named, f"--help names no variable for {flag}"
        text, value = _sample(f)
        environ = {named[flag]: text}
        if f.name != "model":
            environ["MLX_SERVER_MODEL"] = "some/model"
        s = parse_settings([], environ)
        assert getattr(s, f.name) == value, (flag, named[flag])
        assert named[flag].startswith("MLX_SERVER_")


def _help(capsys) -> str:
    with pytest.raises(SystemExit):
        parse_settings(["--help"], {})
    return capsys.readouterr().out


def test_a_flag_wins_over_its_environment_variable():
    s = parse_settings(["-m", "flagged", "--port", "9002"], {"MLX_SERVER_PORT": "9001"})
    assert (s.model, s.port) == ("flagged", 9002)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("MLX_SERVER_PORT", "eighty"),
        ("MLX_SERVER_MAX_BATCH_SIZE", "-2"),
        ("MLX_SERVER_ALLOW_REMOTE_IMAGES", "maybe"),
        ("MLX_SERVER_DTYPE", "float8"),
    ],
)
def test_bad_environment_values_exit_2_naming_the_variable_or_flag(capsys, name, value):
    err = fails(capsys, ["-m", "x"], {name: value})
    assert name in err or name.removeprefix("MLX_SERVER_").lower().replace("_", "-") in err


def test_the_model_is_still_required_without_its_variable(capsys):
    assert "--model" in fails(capsys, [])


def test_the_server_refuses_a_negative_batch_size_at_start():
    done = subprocess.run(
        [sys.executable, "-m", "mlx_server", "-m", "x", "--max-batch-size", "-1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--max-batch-size must be at least 0" in done.stderr
