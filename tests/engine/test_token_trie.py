"""The prefix cache's trie answers as mlx-lm's ``PromptTrie`` does (random adds, pops, prefix
pops and searches side by side), without walking what is stored below a prompt's parting
point, and with a node per branch and entry rather than per token."""

from __future__ import annotations

import random
import time

import pytest
from mlx_lm.models.cache import PromptTrie

from mlx_server.engine.cache import trie
from mlx_server.engine.cache.trie import TokenTrie


def _same(ours, theirs, trie: TokenTrie, tokens: list[int]) -> None:
    assert ours.exact == theirs.exact
    assert ours.shorter == theirs.shorter
    assert ours.common_prefix == theirs.common_prefix
    assert (ours.longer is None) == (theirs.longer is None)
    if ours.longer is not None:
        # the shortest entry past the common prefix (among equals mlx-lm may pick another)
        assert len(ours.longer) == len(theirs.longer)
        assert ours.longer[: ours.common_prefix] == tokens[: ours.common_prefix]
        trie.get("m", ours.longer)  # an entry


# (seed, tokens, longest new run): short runs over six tokens meet at every place; long runs
# over three part inside long runs, split them and join them again.
@pytest.mark.parametrize(
    "seed,alphabet,run", [(s, 5, 8) for s in range(8)] + [(s, 2, 40) for s in range(4)]
)
def test_random_operations_agree_with_mlx_lm(seed, alphabet, run):
    rng = random.Random(seed)
    ours, theirs = TokenTrie(), PromptTrie()
    stored: list[list[int]] = []

    def sequence() -> list[int]:
        if stored and rng.random() < 0.6:  # share a prefix with a stored one
            base = rng.choice(stored)
            cut = rng.randint(0, len(base))
            return base[:cut] + [rng.randint(0, alphabet) for _ in range(rng.randint(0, run - 2))]
        return [rng.randint(0, alphabet) for _ in range(rng.randint(0, run))]

    for _ in range(400):
        op = rng.random()
        tokens = sequence()
        if op < 0.45:
            assert ours.add("m", tokens, tuple(tokens)) == theirs.add("m", tokens, tuple(tokens))
            if tokens not in stored:
                stored.append(tokens)
        elif op < 0.6 and stored:
            victim = rng.choice(stored)
            assert ours.pop("m", victim) == theirs.pop("m", victim)
            stored.remove(victim)
        elif op < 0.67 and stored:
            base = rng.choice(stored)
            got = ours.pop_prefixes("m", base)
            assert got == theirs.pop_prefixes("m", base)
            for n, _ in got:
                stored.remove(base[:n])
        _same(ours.search("m", tokens), theirs.search("m", tokens), ours, tokens)
        for s in stored:
            assert ours.get("m", s) == theirs.get("m", s) == tuple(s)
    assert ours.search("other", [1]).common_prefix == 0


def test_missing_entries_raise_key_error_as_mlx_lm_does():
    ours = TokenTrie()
    ours.add("m", [1, 2, 3], "x")
    theirs = PromptTrie()
    theirs.add("m", [1, 2, 3], "x")
    for t in (ours, theirs):
        with pytest.raises(KeyError):
            t.get("m", [1, 2])
        with pytest.raises(KeyError):
            t.pop("m", [1, 2])
        with pytest.raises(KeyError):
            t.get("m", [4])
    assert ours.pop("m", [1, 2, 3]) == "x"
    assert ours.search("m", [1, 2, 3]).longer is None  # nothing left below the root


def _nodes(node) -> int:
    return 1 + sum(_nodes(c) for c in node.children.values())


def test_a_long_entry_is_one_node_and_its_turns_replace_each_other():
    """An agent session's turns: each stored turn extends the last, whose entry goes
    (``pop_prefixes``); the trie keeps a node per entry and branch, never per token."""
    rng = random.Random(1)
    ours = TokenTrie()
    turn = [rng.randint(0, 50_000) for _ in range(32_000)]
    assert ours.add("m", turn, 0) is None
    assert _nodes(ours._roots["m"]) == 2
    for i in range(1, 4):
        longer = turn + [rng.randint(0, 50_000) for _ in range(500)]
        ours.add("m", longer, i)
        assert _nodes(ours._roots["m"]) == 3  # the old turn's end is a branch point for now
        assert ours.pop_prefixes("m", longer) == [(len(turn), i - 1)]
        assert _nodes(ours._roots["m"]) == 2  # joined again
        assert ours.get("m", longer) == i
        res = ours.search("m", longer[:-10] + [7])
        assert res.longer == longer and res.common_prefix == len(longer) - 10
        turn = longer
    assert ours.pop("m", turn) == 3
    assert _nodes(ours._roots["m"]) == 1


def test_a_search_does_not_walk_the_stored_conversations_below_a_shared_prefix(monkeypatch):
    """Sixty stored sessions of 2,000 tokens after one system prompt: a new session's
    search parts at the system prompt; mlx-lm's walks all 120,000 nodes below it."""
    system = list(range(500))
    ours, theirs = TokenTrie(), PromptTrie()
    rng = random.Random(0)
    for i in range(60):
        tokens = system + [1000 + i] + [rng.randint(0, 50_000) for _ in range(2000)]
        ours.add("m", tokens, i)
        theirs.add("m", tokens, i)
    prompt = system + [999, 7, 8]
    steps = []
    common = trie._common
    monkeypatch.setattr(trie, "_common", lambda *a: steps.append(1) or common(*a))
    t = time.perf_counter()
    res = ours.search("m", prompt)
    ours_s = time.perf_counter() - t
    t = time.perf_counter()
    ref = theirs.search("m", prompt)
    theirs_s = time.perf_counter() - t
    _same(res, ref, ours, prompt)
    assert res.common_prefix == len(system)
    assert len(res.longer) == len(system) + 2001
    assert len(steps) == 1  # the system prompt's run compared once; no session walked
    assert _nodes(ours._roots["m"]) == 1 + 1 + 60  # the root, the system prompt, the sessions
    print(f"search: ours {ours_s * 1e3:.2f} ms, mlx-lm {theirs_s * 1e3:.2f} ms")
