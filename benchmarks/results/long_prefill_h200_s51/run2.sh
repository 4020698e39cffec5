#!/bin/bash
# Session 51, call 2 (H200): warm prefill time of the whole 8B shape (32 layers) with the
# quantized stores' attention output evaluated per layer or left lazy (VQ_PREFILL_EVAL), at
# 4k and 32k, one process per mode, one after the other.
source benchmarks/install_on_device.sh >/dev/null 2>&1
for mode in lazy eval; do
  VQ_PREFILL_EVAL=$mode VQ_MEMORY_LIMIT_GB=60 python3 benchmarks/decode.py --preset llama3-8b \
    --contexts 4096 32768 --methods "mlx-lm KVCache" kivi-4bit kitty --steps 4 --rounds 1 \
    --warmup-rounds 0 --prefill-repeats 2 --budget-s 250 --out $OUT/decode_$mode.json > $OUT/decode_$mode.log 2>&1
done
grep -B2 -A12 "prefill" $OUT/decode_*.log | tail -n 80
