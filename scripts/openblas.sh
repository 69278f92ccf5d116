#!/usr/bin/env bash
# Source this on Linux: preloads OpenBLAS when it is installed (MLX's float32 matmuls on the
# CPU are several times faster with it). Install it with: apt-get install libopenblas0-pthread
if [ "$(uname -s)" = "Linux" ] && [ -z "${MLX_SERVER_NO_OPENBLAS:-}" ]; then
  for so in /usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0 /usr/lib/*-linux-gnu/libopenblas.so.0; do
    if [ -e "$so" ]; then
      export LD_PRELOAD="${LD_PRELOAD:+$LD_PRELOAD:}$so"
      break
    fi
  done
fi
