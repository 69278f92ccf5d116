"""Which JIT-built kernels a server start built, and when: MLX's CUDA backend writes each
module it compiles to ``MLX_PTX_CACHE_DIR`` as it is built, so on an empty cache the files'
times say what the start built before its readiness line and what its first answer waited
for; the gap before a file is (about) its build time when nothing else was being built.

    python3 ptx_times.py CACHE_DIR T_START T_READY T_ANSWER
"""

import os
import sys
from collections import defaultdict


def main() -> None:
    root, t0, ready, answer = sys.argv[1], *map(float, sys.argv[2:5])
    files = []
    for base, _, names in os.walk(root):
        for n in names:
            if n.endswith(".ptx"):
                path = os.path.join(base, n)
                files.append((os.path.getmtime(path), os.path.relpath(path, root)[:-4]))
    files.sort()
    phases = {
        "before readiness": (t0, ready),
        "first answer": (ready, answer),
        "later": (answer, 1e18),
    }
    prev = t0
    per_phase: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for t, name in files:
        phase = next(p for p, (a, b) in phases.items() if a <= t < b or p == "later")
        per_phase[phase].append((t - prev, name.replace("/", "")))
        prev = t
    for phase, (a, b) in phases.items():
        got = per_phase.get(phase, [])
        span = (b - a) if b < 1e18 else max(0.0, prev - a)
        print(
            f"{phase}: {len(got)} modules built (phase {span:.1f} s; gaps sum {sum(g for g, _ in got):.1f} s)"
        )
        kinds: dict[str, list[float]] = defaultdict(list)
        for gap, name in got:
            kinds["_".join(name.split("_")[:2])[:24]].append(gap)
        for kind, gaps in sorted(kinds.items(), key=lambda kv: -sum(kv[1]))[:8]:
            print(f"  {kind:<24} {len(gaps):>4} modules, {sum(gaps):7.1f} s")
        for gap, name in sorted(got, reverse=True)[:6]:
            print(f"    {gap:6.2f} s  {name[:110]}")


if __name__ == "__main__":
    main()
