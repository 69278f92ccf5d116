"""Ollama's native API (``/api/chat``, ``/api/generate``, ``/api/tags``, ``/api/show``,
``/api/ps``, ``/api/version``, ``/api/embed``): schemas at the edge, an adapter to the
neutral requests, an encoder of NDJSON chunks, errors as ``{"error": "..."}``."""
