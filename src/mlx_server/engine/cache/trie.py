"""The prefix cache's token trie: mlx-lm's ``PromptTrie`` interface (``add``, ``get``, ``pop``,
``pop_prefixes``, ``search`` and its ``PromptTrieResult``), with a search whose cost does not
grow with what is stored below the point where a prompt parts from the stored ones, and
operations whose Python work does not grow with an entry's length.

mlx-lm's search finds the shortest stored entry extending a prompt's common prefix (the
``longer`` one, which a trimmable cache rewinds) by walking the whole subtree below that
point depth first, copying the path at every node: for conversations that share a system
prompt, every stored conversation below it, at a cost of nodes × depth. Measured on this
project's CPU with 32 stored answers of ~225 tokens: 2 ms a search, three searches to admit a
request (a quarter of the engine's time in a burst of 32); with agent sessions of thousands
of tokens it grows to seconds. Here each node knows how far below it the nearest entry is
(kept on every change along the changed path), so the search follows the nearest child
down.

The trie is compressed (a radix tree): a node holds the run of tokens leading to it from the
last branch, so a stored entry costs a node or two, not a node per token, and each operation
walks the branch points only, comparing runs of tokens as list slices. With one node per
token, storing a 32k-token agent session took 6 ms for the add and 25 ms to take out its
shorter prefixes (this project's CPU), on the engine's thread, at every turn.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models.cache import PromptTrieResult

_NONE = float("inf")


class _Node:
    __slots__ = ("children", "has_value", "label", "nearest", "value")

    def __init__(self, label: list[int]) -> None:
        self.label = label  # the tokens from the parent to this node (the root: none)
        self.children: dict[int, _Node] = {}  # by the first token of their label
        self.value: Any = None
        self.has_value = False
        self.nearest: float = _NONE  # tokens down to the nearest entry (0: here)

    def settle(self) -> None:
        """Recompute ``nearest`` from this node's own entry and its children's."""
        if self.has_value:
            self.nearest = 0
        else:
            self.nearest = _NONE
            for c in self.children.values():
                d = len(c.label) + c.nearest
                if d < self.nearest:
                    self.nearest = d


def _common(label: list[int], tokens: list[int], start: int) -> int:
    """How many of ``label``'s leading tokens ``tokens[start:]`` repeats (compared as slices,
    halving the run where it parts)."""
    n = len(tokens) - start
    if len(label) < n:
        n = len(label)
    if tokens[start : start + n] == label[:n]:
        return n
    lo, hi = 0, n  # label[:lo] is repeated, label[:hi] is not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tokens[start : start + mid] == label[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class TokenTrie:
    """Entries keyed by a model and a token sequence (see the module docstring)."""

    def __init__(self) -> None:
        self._roots: dict[Any, _Node] = {}

    def add(self, model: Any, tokens: list[int], value: Any) -> Any:
        """Store ``value`` for ``tokens``; returns the value it replaced (or None)."""
        tokens = list(tokens)
        node = self._roots.setdefault(model, _Node([]))
        path = [node]
        i, n = 0, len(tokens)
        while i < n:
            child = node.children.get(tokens[i])
            if child is None:
                child = node.children[tokens[i]] = _Node(tokens[i:])
                i = n
            else:
                k = _common(child.label, tokens, i)
                if k < len(child.label):  # parts inside the run: a branch point there
                    mid = node.children[tokens[i]] = _Node(child.label[:k])
                    child.label = child.label[k:]
                    mid.children[child.label[0]] = child
                    child = mid
                i += k
            node = child
            path.append(node)
        prev = node.value if node.has_value else None
        node.value, node.has_value = value, True
        for at in reversed(path):
            at.settle()
        return prev

    def _path(self, model: Any, tokens: list[int]) -> list[_Node]:
        """The nodes from the root to the one ``tokens`` end at (KeyError where they end
        at none)."""
        node = self._roots[model]
        path = [node]
        i, n = 0, len(tokens)
        while i < n:
            node = node.children[tokens[i]]
            k = len(node.label)
            if tokens[i : i + k] != node.label:
                raise KeyError("__value__")
            i += k
            path.append(node)
        return path

    def get(self, model: Any, tokens: list[int]) -> Any:
        """The value stored for ``tokens``; KeyError when there is none."""
        node = self._path(model, list(tokens))[-1]
        if not node.has_value:
            raise KeyError("__value__")
        return node.value

    def pop(self, model: Any, tokens: list[int]) -> Any:
        """Remove and return the value stored for ``tokens`` (KeyError when none); nodes
        left with neither an entry nor children go with it, and a node left with neither an
        entry nor a branch joins its only child."""
        path = self._path(model, list(tokens))
        node = path[-1]
        if not node.has_value:
            raise KeyError("__value__")
        value = node.value
        node.value, node.has_value = None, False
        _tidy(path)
        return value

    def pop_prefixes(self, model: Any, tokens: list[int]) -> list[tuple[int, Any]]:
        """Remove the entries of ``tokens``' proper prefixes; returns ``(length, value)``."""
        tokens = list(tokens)
        node = self._roots[model]
        path = [node]
        ends = [0]
        i, n = 0, len(tokens)
        while i < n:
            node = node.children[tokens[i]]
            k = _common(node.label, tokens, i)
            if k < len(node.label):
                if i + k < n:
                    raise KeyError(tokens[i + k])  # no stored path follows ``tokens``
                break  # ``tokens`` end inside this run: no entry in it is a proper prefix
            i += k
            path.append(node)
            ends.append(i)
        values = []
        for at, end in zip(path, ends, strict=True):
            if at.has_value and end < n:
                values.append((end, at.value))
                at.value, at.has_value = None, False
        _tidy(path)
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
        tokens = list(tokens)
        last = -1
        index, n = 0, len(tokens)
        inside: _Node | None = None  # the node whose run the prompt parts from, if inside one
        inside_k = 0  # how many of its run's tokens the prompt repeats
        while index < n:
            child = node.children.get(tokens[index])
            if child is None:
                break
            k = _common(child.label, tokens, index)
            index += k
            if k < len(child.label):
                inside, inside_k = child, k
                break
            node = child
            if node.has_value:
                last = index - 1
        if last == n - 1 >= 0:
            return PromptTrieResult(model, tokens, None, None, 0)
        shorter = tokens[: last + 1] if last > 0 else None
        longer = None
        if index > 0 and node.nearest != _NONE:
            extra: list[int] = []
            if inside is not None:  # the rest of the run first
                extra += inside.label[inside_k:]
                node = inside
            while not node.has_value:
                best: _Node | None = None
                for c in node.children.values():
                    if best is None or len(c.label) + c.nearest < len(best.label) + best.nearest:
                        best = c
                assert best is not None
                extra += best.label
                node = best
            longer = tokens[:index] + extra
        return PromptTrieResult(model, None, shorter, longer, index)


def _tidy(path: list[_Node]) -> None:
    """After entries along ``path`` (root first) were taken out: drop the nodes left with
    neither an entry nor children, join each node left with neither an entry nor a branch
    to its only child, and recompute ``nearest`` up to the root."""
    for j in range(len(path) - 1, -1, -1):
        at = path[j]
        if j > 0 and not at.has_value and len(at.children) <= 1:
            parent = path[j - 1]
            if not at.children:
                del parent.children[at.label[0]]
            else:
                (only,) = at.children.values()
                only.label = at.label + only.label
                parent.children[at.label[0]] = only
            continue
        at.settle()
