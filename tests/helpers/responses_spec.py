"""Validators for the Responses API schema extract (tests/specs/openai-responses.schema.json).

``ResponseStreamEvent`` is an ``anyOf`` of every event; each event is checked against the one
schema its ``type`` names, so a wrong field is reported for that event and not hidden by
another branch.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema

SPEC = Path(__file__).parents[1] / "specs" / "openai-responses.schema.json"


@cache
def _doc() -> dict[str, Any]:
    return json.loads(SPEC.read_text())


@cache
def validator(name: str) -> jsonschema.Draft202012Validator:
    doc = _doc()
    root = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    return jsonschema.Draft202012Validator(root)


@cache
def event_schemas() -> dict[str, str]:
    """Stream event type → the name of its schema."""
    schemas = _doc()["components"]["schemas"]
    out = {}
    for ref in schemas["ResponseStreamEvent"]["anyOf"]:
        name = ref["$ref"].rsplit("/", 1)[-1]
        out[schemas[name]["properties"]["type"]["enum"][0]] = name
    return out


def validate_response(obj: dict[str, Any]) -> None:
    validator("Response").validate(obj)


def validate_event(event: dict[str, Any]) -> None:
    name = event_schemas().get(event.get("type", ""))
    assert name is not None, f"unknown stream event type {event.get('type')!r}"
    validator(name).validate(event)


def validate_error(body: dict[str, Any]) -> None:
    validator("ErrorResponse").validate(body)


def validate_item_list(body: dict[str, Any]) -> None:
    validator("ResponseItemList").validate(body)


def parse_sse(lines: list[str]) -> list[dict[str, Any]]:
    """``event: T`` / ``data: {...}`` frames → events; checks that each frame's two names agree."""
    events = []
    name = None
    for line in lines:
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            event = json.loads(line[6:])
            assert event["type"] == name, (name, event["type"])
            events.append(event)
            name = None
    return events
