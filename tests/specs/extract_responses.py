"""Extract the Responses API schemas from OpenAI's OpenAPI document (see PROVENANCE.md).

    python tests/specs/extract_responses.py path/to/openapi.json > tests/specs/openai-responses.schema.json

Keeps the transitive ``$ref`` closure of the roots, applies the same pre-pass as the other
extracts (nullable rewrite, annotations stripped) and records the source's sha256.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

ROOTS = ["Response", "ResponseStreamEvent", "ResponseItemList", "ErrorResponse", "Error"]
STRIP = {"description", "title", "examples", "example", "deprecated"}


def refs(node: Any, out: set[str]) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str):
                out.add(v.rsplit("/", 1)[-1])
            else:
                refs(v, out)
    elif isinstance(node, list):
        for v in node:
            refs(v, out)


def closure(schemas: dict[str, Any], roots: list[str]) -> list[str]:
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        found: set[str] = set()
        refs(schemas[name], found)
        todo.extend(found - seen)
    return sorted(seen)


def denull(node: Any, count: list[int]) -> Any:
    """OAS-3.0 ``nullable: true`` → JSON Schema 2020-12 (which ignores ``nullable``)."""
    if isinstance(node, list):
        return [denull(v, count) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: denull(v, count) for k, v in node.items()}
    if node.pop("nullable", False) is True:
        count[0] += 1
        if "type" in node and isinstance(node["type"], str):
            node["type"] = [node["type"], "null"]
            if "enum" in node:
                node["enum"] = [*node["enum"], None]
        else:
            node = {"anyOf": [node, {"type": "null"}]}
    return node


def strip(node: Any, in_properties: bool = False) -> Any:
    if isinstance(node, list):
        return [strip(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if not in_properties and (k in STRIP or k.startswith(("x-oai", "x-stainless"))):
            continue
        out[k] = strip(v, in_properties=(k == "properties" and not in_properties))
    return out


def main(path: str) -> None:
    raw = open(path, "rb").read()
    doc = json.loads(raw)
    schemas = doc["components"]["schemas"]
    names = closure(schemas, ROOTS)
    examples = {n: schemas[n]["example"] for n in ROOTS if "example" in schemas[n]}
    count = [0]
    kept = {n: strip(denull(schemas[n], count)) for n in names}
    out = {
        "openapi": "3.1.0",
        "info": {"title": "OpenAI Responses API schema extract", "version": doc["info"]["version"]},
        "x-extract": {
            "source": "openai/openai-openapi openapi.json",
            "sha256": hashlib.sha256(raw).hexdigest(),
            "roots": ROOTS,
            "nullable_rewrites": count[0],
        },
        "x-harness-examples": examples,
        "components": {"schemas": kept},
    }
    json.dump(out, sys.stdout, indent=1, sort_keys=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main(sys.argv[1])
