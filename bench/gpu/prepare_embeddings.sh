#!/bin/bash
# Run on the development machine, in the project's root (`bash bench/gpu/prepare_embeddings.sh`), after
# `mlx-server-demo --embedding` has put all-MiniLM-L6-v2 in models/. Builds .gpu/e (git-ignored, about 48 MB, apart from
# .gpu/a and .gpu/b: a run carries 64 MiB): the embedding demo model with float16 weights (pack_embedding_model.py)
# and the wheels bench/gpu/embeddings.sh may need there, downloaded with --no-deps for the device's Python 3.12: the
# pinned mlx-embeddings and the mlx-vlm it imports, sentence-transformers (the image has one; ours is installed only
# where it lacks it). EXTRA_WHEELS="transformers==5.x ..." adds more, for an image that lacks them.
# Then on the GPU machine: `bash .gpu/a/lay.sh` (.gpu/a along), `bash bench/gpu/install.sh` (.gpu/b along; or the
# whole device_bench.sh), `bash bench/gpu/embeddings.sh` (.gpu/e along). docs/benchmarks.md, "GPU".
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
MODEL=${MODEL:-models/all-minilm-l6-v2}
PY=${PY:-.venv/bin/python}; [ -x "$PY" ] || PY=python3
[ -f "$MODEL/config.json" ] || { echo "no model at $MODEL (run mlx-server-demo --embedding first)"; exit 1; }
EXCLUDE=$(git rev-parse --git-path info/exclude)
grep -qx '/.gpu/' "$EXCLUDE" 2>/dev/null || echo '/.gpu/' >> "$EXCLUDE"
ver() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
WHEELS="mlx-embeddings==$(ver mlx-embeddings) mlx-vlm==$(ver mlx-vlm) sentence-transformers==$(ver sentence-transformers) ${EXTRA_WHEELS:-}"
rm -rf .gpu/e && mkdir -p .gpu/e/wheels
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform any"
for n in 17 27 28 31 34 35; do PLAT="$PLAT --platform manylinux_2_${n}_x86_64"; done
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps $PLAT -d .gpu/e/wheels $WHEELS
"$PY" "$HERE/pack_embedding_model.py" "$MODEL" .gpu/e/model
du -sh .gpu/e .gpu/e/*
size=$(du -sb .gpu/e | cut -f1)
[ "$size" -lt 60000000 ] || { echo ".gpu/e is $size bytes: over what a run may carry beside the project"; exit 1; }
