"""What the Ollama API tests share: validators of tests/specs/ollama-api.schema.json and an
NDJSON reader."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema

_DOC = json.loads((Path(__file__).parents[1] / "specs" / "ollama-api.schema.json").read_text())


def ollama_validator(name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator({"$ref": f"#/$defs/{name}", "$defs": _DOC["$defs"]})


CHAT_CHUNK = ollama_validator("chat_chunk")
GENERATE_CHUNK = ollama_validator("generate_chunk")
TAGS = ollama_validator("tags")
PS = ollama_validator("ps")
SHOW = ollama_validator("show")
VERSION = ollama_validator("version")
EMBED = ollama_validator("embed")
EMBEDDINGS = ollama_validator("embeddings")
ERROR = ollama_validator("error")


def ndjson(base_url: str, path: str, body: dict, **kw) -> list[dict]:
    """Every line of a streamed answer, parsed (each must be one JSON object)."""
    with httpx.stream("POST", base_url + path, json=body, timeout=30, **kw) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("application/x-ndjson")
        return [json.loads(line) for line in r.iter_lines() if line]
