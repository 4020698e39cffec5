#!/bin/bash
# Session 53, run 8 (a fresh machine): amc's PCA through leading_basis (rank 32 of 128:
# subspace iteration in place of the 128 x 128 eigh per head, keys and values): the whole
# 8B shape at 4k (session 46: 1.596 s warm, 14.54x mlx-lm's KVCache).
source benchmarks/install_on_device.sh >/dev/null 2>&1
VQ_MEMORY_LIMIT_GB=60 timeout 330 python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 \
  --methods "mlx-lm KVCache" amc --steps 4 --rounds 1 \
  --warmup-rounds 0 --prefill-repeats 1 --budget-s 300 --out $OUT/decode_amc.json > $OUT/decode_amc.log 2>&1
grep -A4 "^| context" $OUT/decode_amc.log || tail -5 $OUT/decode_amc.log
