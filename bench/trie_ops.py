"""The prefix cache's trie against mlx-lm's ``PromptTrie``: one entry of L tokens stored, an
extension of it by 100 tokens stored, the extension's shorter prefixes taken out (a new turn
replacing the last), a search that parts inside the stored run, and a pop; milliseconds each,
and mlx-lm's time over ours.

    PYTHONPATH=src .venv/bin/python bench/trie_ops.py [--lengths 200,2000,8000,32000]
"""

from __future__ import annotations

import argparse
import gc
import random
import time

from mlx_lm.models.cache import PromptTrie

from mlx_server.engine.cache.trie import TokenTrie


def ops(trie: object, length: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    tokens = [rng.randrange(50_000) for _ in range(length)]
    longer = tokens + [rng.randrange(50_000) for _ in range(100)]
    steps = (
        ("add", lambda: trie.add("m", tokens, 1)),
        ("add an extension", lambda: trie.add("m", longer, 2)),
        ("pop prefixes", lambda: trie.pop_prefixes("m", longer)),
        ("search", lambda: trie.search("m", longer[:-5] + [50_001])),
        ("pop", lambda: trie.pop("m", longer)),
    )
    out = {}
    for name, step in steps:
        t0 = time.perf_counter()
        step()
        out[name] = (time.perf_counter() - t0) * 1e3
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", default="200,2000,8000,32000")
    a = p.parse_args()
    gc.disable()  # a collection inside one timed call would blur it
    for length in (int(x) for x in a.lengths.split(",")):
        ours = ops(TokenTrie(), length, length)
        theirs = ops(PromptTrie(), length, length)
        row = ", ".join(
            f"{k} {ours[k]:.3f} ms (mlx-lm {theirs[k]:.3f}, {theirs[k] / max(ours[k], 1e-9):.0f} x)"
            for k in ours
        )
        print(f"L = {length}: {row}", flush=True)


if __name__ == "__main__":
    main()
