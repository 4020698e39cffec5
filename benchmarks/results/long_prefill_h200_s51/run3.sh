#!/bin/bash
# Session 51, call 3 (H200): as call 2, with each layer's attention output scheduled
# (async_eval) and the previous layer's waited for (VQ_PREFILL_EVAL=lag1).
source benchmarks/install_on_device.sh >/dev/null 2>&1
for mode in lag1; do
  VQ_PREFILL_EVAL=$mode VQ_MEMORY_LIMIT_GB=60 python3 benchmarks/decode.py --preset llama3-8b \
    --contexts 4096 32768 --methods "mlx-lm KVCache" kivi-4bit kitty --steps 4 --rounds 1 \
    --warmup-rounds 0 --prefill-repeats 2 --budget-s 250 --out $OUT/decode_$mode.json > $OUT/decode_$mode.log 2>&1
done
grep -A8 "^| context" $OUT/decode_*.log
