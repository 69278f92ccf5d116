"""The prefix cache's token trie: mlx-lm's ``PromptTrie`` interface (``add``, ``get``, ``pop``,
``pop_prefixes``, ``search`` and its ``PromptTrieResult``), with a search whose cost does not
grow with what is stored below the point where a prompt parts from the stored ones.

mlx-lm's search finds the shortest stored entry extending a prompt's common prefix (the
``longer`` one, which a trimmable cache rewinds) by walking the whole subtree below that
point depth first, copying the path at every node: for conversations that share a system
prompt, every stored conversation below it, at a cost of nodes × depth. Measured on this
project's CPU with 32 stored answers of ~225 tokens: 2 ms a search, three searches to admit a
request (a quarter of the engine's time in a burst of 32); with agent sessions of thousands
of tokens it grows to seconds. Here each node knows how far below it the nearest entry is
(kept on every change along the changed path), so the search follows the nearest child
down: the cost is the prompt's length plus the entry's.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import PromptTrieResult

_NONE = float("inf")


class _Node:
    __slots__ = ("children", "has_value", "nearest", "value")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.value: Any = None
        self.has_value = False
        self.nearest: float = _NONE  # tokens down to the nearest entry (0: here)

    def settle(self) -> None:
        """Recompute ``nearest`` from this node's own entry and its children's."""
        if self.has_value:
            self.nearest = 0
        else:
            self.nearest = min((c.nearest for c in self.children.values()), default=_NONE) + 1


class TokenTrie:
    """Entries keyed by a model and a token sequence (see the module docstring)."""

    def __init__(self) -> None:
        self._roots: dict[Any, _Node] = {}

    def add(self, model: Any, tokens: list[int], value: Any) -> Any:
        """Store ``value`` for ``tokens``; returns the value it replaced (or None)."""
        node = self._roots.setdefault(model, _Node())
        path = [node]
        for tok in tokens:
            child = node.children.get(tok)
            if child is None:
                child = node.children[tok] = _Node()
            node = child
            path.append(node)
        prev = node.value if node.has_value else None
        node.value, node.has_value = value, True
        n = len(tokens)
        for depth, at in enumerate(path):
            at.nearest = min(at.nearest, n - depth)
        return prev

    def _path(self, model: Any, tokens: list[int]) -> list[_Node]:
        node = self._roots[model]
        path = [node]
        for tok in tokens:
            node = node.children[tok]
            path.append(node)
        return path

    def get(self, model: Any, tokens: list[int]) -> Any:
        """The value stored for ``tokens``; KeyError when there is none."""
        node = self._path(model, tokens)[-1]
        if not node.has_value:
            raise KeyError("__value__")
        return node.value

    def pop(self, model: Any, tokens: list[int]) -> Any:
        """Remove and return the value stored for ``tokens`` (KeyError when none); nodes
        left with neither an entry nor children go with it."""
        path = self._path(model, tokens)
        node = path[-1]
        if not node.has_value:
            raise KeyError("__value__")
        value = node.value
        node.value, node.has_value = None, False
        for i in range(len(tokens), -1, -1):
            at = path[i]
            if i > 0 and not at.has_value and not at.children:
                del path[i - 1].children[tokens[i - 1]]
            else:
                at.settle()
        return value

    def pop_prefixes(self, model: Any, tokens: list[int]) -> list[tuple[int, Any]]:
        """Remove the entries of ``tokens``' proper prefixes; returns ``(length, value)``."""
        values = []
        node = self._roots[model]
        path = [node]
        for i, tok in enumerate(tokens):
            if node.has_value:
                values.append((i, node.value))
                node.value, node.has_value = None, False
            node = node.children[tok]
            path.append(node)
        for at in reversed(path):
            at.settle()
        return values

    def search(self, model: Any, tokens: list[int]) -> PromptTrieResult:
        """What mlx-lm's search answers: the exact entry, else the longest stored prefix
        (``shorter``), the shortest entry extending the longest common prefix (``longer``)
        and that prefix's length."""
        node = self._roots.get(model)
        if node is None:
            return PromptTrieResult(model, None, None, None, 0)
        if not tokens and node.has_value:
            return PromptTrieResult(model, [], None, None, 0)
        last = -1
        index = 0
        while index < len(tokens):
            child = node.children.get(tokens[index])
            if child is None:
                break
            node = child
            if node.has_value:
                last = index
            index += 1
        if last == len(tokens) - 1 >= 0:
            return PromptTrieResult(model, tokens, None, None, 0)
        shorter = tokens[: last + 1] if last > 0 else None
        longer = None
        if index > 0 and node.nearest != _NONE:
            extra: list[int] = []
            while not node.has_value:
                tok, node = min(node.children.items(), key=lambda kv: kv[1].nearest)
                extra.append(tok)
            longer = tokens[:index] + extra
        return PromptTrieResult(model, None, shorter, longer, index)
