#!/bin/bash
# Session 51, call 5 (H200): the whole 8B shape (32 layers) with the landed pacing, more
# quantized stores: warm prefill time and peak against mlx-lm's KVCache in the same run.
source benchmarks/install_on_device.sh >/dev/null 2>&1
VQ_MEMORY_LIMIT_GB=60 python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 32768 \
  --methods "mlx-lm KVCache" kivi-2bit gear cachegen turboquant palu --steps 4 --rounds 1 \
  --warmup-rounds 0 --prefill-repeats 1 --budget-s 330 --out $OUT/decode_paced.json > $OUT/decode_paced.log 2>&1
grep -A14 "^| context" $OUT/decode_paced.log
