#!/bin/bash
# Run on the development machine, in the project's root, after `.venv/bin/mlx-server-demo` has imported the demo
# model (4-bit, ~115 MB). Splits it over three folders that travel beside the kit's own, each run within the 64 MiB a
# call may carry: .gpu/d1 (~17 MB, with .gpu/b), .gpu/d2 (~52 MB, alone), .gpu/d3 (the rest, alone). On the GPU
# machine each run parks its part in /tmp/kit/demo (bench/gpu/park_demo.sh); speculative.sh joins them and runs the
# model dequantized to float16 (docs/benchmarks.md, "Speculative decoding").
# Env: DEMO=models/smollm2-135m-instruct (any MLX model folder with one model.safetensors).
set -euo pipefail
DEMO=${DEMO:-models/smollm2-135m-instruct}
[ -f "$DEMO/model.safetensors" ] || { echo "no demo model at $DEMO (run .venv/bin/mlx-server-demo first)"; exit 1; }
if [ -d .git ]; then grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude; fi
rm -rf .gpu/d1 .gpu/d2 .gpu/d3 && mkdir -p .gpu/d1 .gpu/d2 .gpu/d3
cp "$DEMO"/*.json .gpu/d1/
(cd "$DEMO" && sha256sum model.safetensors) > .gpu/d1/model.sha256
# 13 MB parts: the first with the kit's second run, the next four in a run of their own, the rest in another.
split -b 13000000 -d -a 2 "$DEMO/model.safetensors" .gpu/d.part.
i=0
for p in .gpu/d.part.*; do
  if [ $i = 0 ]; then mv "$p" .gpu/d1/; elif [ $i -le 4 ]; then mv "$p" .gpu/d2/; else mv "$p" .gpu/d3/; fi
  i=$((i + 1))
done
du -sb .gpu/d1 .gpu/d2 .gpu/d3
