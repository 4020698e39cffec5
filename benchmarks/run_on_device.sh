#!/bin/bash
# Second device call (after `mkdir -p /tmp/p && cp .device/a/* /tmp/p/` with carry .device/a;
# this one with carry .device/b): install MLX's CUDA build once per warm machine, then run
# the given command with it on the path. Usage: bash benchmarks/run_on_device.sh CMD...
set -o pipefail
if [ ! -d /tmp/site/mlx ]; then
  cat /tmp/p/cuda.part.aa .device/b/cuda.part.ab > /tmp/$(cat /tmp/p/cuda-wheel-name) &&
    python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/p/mlx-*.whl \
      /tmp/mlx_cuda_13-*.whl || exit 1
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
"$@"
