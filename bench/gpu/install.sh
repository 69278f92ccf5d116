#!/bin/bash
# On the GPU machine, right after `bash .gpu/a/lay.sh` (first run), with .gpu/b along: installs MLX for CUDA and the
# kit's wheels into /tmp/site, which lives as long as the machine stays warm. device_bench.sh runs it first; run it
# alone (`bash bench/gpu/install.sh`) before a run that needs MLX without the whole bench (bench/gpu/embeddings.sh).
K=${K:-/tmp/kit/a}; S=${S:-/tmp/site}
[ -d $S/mlx ] && exit 0
[ -f $K/mlx_cuda.name ] || { echo "no kit in $K: run 'bash .gpu/a/lay.sh' with .gpu/a along first"; exit 1; }
ls .gpu/b/mlx_cuda.part.* > /dev/null 2>&1 || { echo "no .gpu/b here: carry .gpu/b"; exit 1; }
W=$K/$(cat $K/mlx_cuda.name)
cat $K/mlx_cuda.part.* .gpu/b/mlx_cuda.part.* > "$W" || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $S $K/wheels/*.whl \
  $(ls .gpu/b/wheels/*.whl 2>/dev/null) "$W" || exit 1
# libmlx.so looks for the CUDA libraries at ../../nvidia beside it: use the image's.
ln -sfn "$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])')" $S/nvidia
