"""Settings: every server option, declared once (default, help, bounds) in ``settings.py``;
the CLI is built from them, and each option can also come from the environment as
``MLX_SERVER_<NAME>`` (for example ``MLX_SERVER_PORT=9000``); a flag on the command line
wins. ``flag_table.py`` writes the flag table of docs/configuration.md from them
(``python -m mlx_server.config --write docs/configuration.md``)."""

from mlx_server.config.cache_root import user_cache_root
from mlx_server.config.options import check_bounds, env_name, split_repeated
from mlx_server.config.settings import Settings, settings_fields

__all__ = [
    "Settings",
    "check_bounds",
    "env_name",
    "settings_fields",
    "split_repeated",
    "user_cache_root",
]
