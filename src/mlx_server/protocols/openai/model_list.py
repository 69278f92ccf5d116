"""The entries of OpenAI's ``GET /v1/models`` list, as every app of this server writes them."""

from __future__ import annotations

import time
from typing import Any


def model_object(model_id: str, **fields: Any) -> dict[str, Any]:
    """One model's entry: OpenAI's fields, then this server's ``fields`` (capabilities,
    context size, a registry's load state ...)."""
    return {
        "id": model_id,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "mlx",
        **fields,
    }
