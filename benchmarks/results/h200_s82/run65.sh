#!/bin/bash
# Session 82: where the fused prompt-mass path's peak comes from (run64c: h2o and keyformer
# at 0.97x KVCache's peak at 4k with it, 0.72x without; 1.08x at 32k): one 8B layer's last
# prompt chunk and token (prefill_peak.py), h2o with and without VQ_FUSED_MASS=1. ~1 minute.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
for ctx in 4096 32768; do
  for fused in 0 1; do
    echo "VQ_FUSED_MASS=$fused"
    VQ_FUSED_MASS=$fused VQ_MEMORY_LIMIT_GB=60 timeout 60 python3 benchmarks/prefill_peak.py --heads 32 8 --context $ctx \
      --dtype float16 --caches "mlx-lm KVCache" "h2o 1024" 2>&1 | tail -3
  done
done
