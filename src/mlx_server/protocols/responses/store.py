"""Stored responses: in memory, bounded by count and bytes, least recently used out first.

Each entry keeps the response object, the request's own input items (for
``/input_items``) and the conversation it ends (every earlier item, this request's input
and its output), which a later request continues with ``previous_response_id``. Nothing
survives a restart.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StoredResponse:
    response: dict[str, Any]
    input_items: list[dict[str, Any]]
    conversation: list[dict[str, Any]]
    size: int = 0


@dataclass
class ResponseStore:
    """An LRU map of response id → StoredResponse within ``max_count`` and ``max_bytes``."""

    max_count: int = 1000
    max_bytes: int = 256 << 20
    _entries: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)
    _bytes: int = 0

    def put(self, entry: StoredResponse) -> None:
        rid = entry.response["id"]
        self.delete(rid)
        entry.size = len(json.dumps([entry.response, entry.input_items, entry.conversation]))
        if entry.size > self.max_bytes or self.max_count <= 0:
            return  # larger than the whole store: not kept
        self._entries[rid] = entry
        self._bytes += entry.size
        while len(self._entries) > self.max_count or self._bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.size

    def get(self, rid: str) -> StoredResponse | None:
        entry = self._entries.get(rid)
        if entry is not None:
            self._entries.move_to_end(rid)
        return entry

    def delete(self, rid: str) -> bool:
        entry = self._entries.pop(rid, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes
