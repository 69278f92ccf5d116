"""Ollama's ``keep_alive``: how long a model stays loaded after a request. Seconds (a number)
or a Go duration string ("5m", "1h30m", "90s", "300ms"); 0 unloads after the request, a
negative value keeps the model loaded."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import AfterValidator

from mlx_server.errors import InvalidRequest

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_DURATION = re.compile(r"(?:(?:\d+(?:\.\d*)?|\.\d+)(?:ns|us|µs|ms|s|m|h))+")


def parse_keep_alive(value: Any) -> float | None:
    """Seconds to keep the model loaded (``math.inf``: for good), or None when not given.
    Raises InvalidRequest naming ``keep_alive``."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise _bad(value)
    if isinstance(value, int | float):
        return _seconds(float(value))
    if isinstance(value, str):
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            return _seconds(sign * float(body))  # "300", "-1": seconds, as Ollama reads them
        except ValueError:
            pass
        if _DURATION.fullmatch(body):
            total = sum(float(n) * _UNITS[u] for n, u in _PART.findall(body))
            return _seconds(sign * total)
    raise _bad(value)


def _seconds(value: float) -> float:
    if math.isnan(value):
        raise _bad(value)
    return math.inf if value < 0 else value


def _bad(value: Any) -> InvalidRequest:
    return InvalidRequest(
        f"keep_alive must be seconds or a duration such as '5m' (0: unload after the "
        f"request, -1: keep loaded), got {value!r}",
        param="keep_alive",
    )


def _checked(value: Any) -> Any:
    parse_keep_alive(value)  # an InvalidRequest passes through the body's validation as is
    return value


# A body's ``keep_alive`` field: checked as it is read (one rule and one message on every
# route, whether a single model ignores it or a registry keeps it).
KeepAliveField = Annotated[Any, AfterValidator(_checked)]
