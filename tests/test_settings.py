"""Settings: every option bounded and checked at start (exit 2 with the reason), and each
one settable from its MLX_SERVER_<NAME> environment variable, the flag winning."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mlx_server.cli import parse_settings
from mlx_server.config import env_name, settings_fields


def fails(capsys, argv, environ=None) -> str:
    with pytest.raises(SystemExit) as e:
        parse_settings(argv, environ or {})
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--max-batch-size", "0"),
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


def test_every_option_has_an_environment_variable(capsys):
    for f in settings_fields():
        assert env_name(f.name) == "MLX_SERVER_" + f.name.upper()
    s = parse_settings(
        [],
        {
            "MLX_SERVER_MODEL": "some/model",
            "MLX_SERVER_PORT": "9001",
            "MLX_SERVER_KV_BUDGET_GB": "1.5",
            "MLX_SERVER_ALLOW_REMOTE_IMAGES": "true",
            "MLX_SERVER_DTYPE": "float32",
        },
    )
    assert (s.model, s.port, s.kv_budget_gb, s.allow_remote_images, s.dtype) == (
        "some/model",
        9001,
        1.5,
        True,
        "float32",
    )
    assert "[env: MLX_SERVER_PORT]" in _help(capsys)


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
        ("MLX_SERVER_MAX_BATCH_SIZE", "0"),
        ("MLX_SERVER_ALLOW_REMOTE_IMAGES", "maybe"),
        ("MLX_SERVER_DTYPE", "float8"),
    ],
)
def test_bad_environment_values_exit_2_naming_the_variable_or_flag(capsys, name, value):
    err = fails(capsys, ["-m", "x"], {name: value})
    assert name in err or name.removeprefix("MLX_SERVER_").lower().replace("_", "-") in err


def test_the_model_is_still_required_without_its_variable(capsys):
    assert "--model" in fails(capsys, [])


def test_the_server_refuses_a_zero_batch_size_at_start():
    done = subprocess.run(
        [sys.executable, "-m", "mlx_server", "-m", "x", "--max-batch-size", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--max-batch-size must be at least 1" in done.stderr
