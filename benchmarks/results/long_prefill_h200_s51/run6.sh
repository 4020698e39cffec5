#!/bin/bash
# Session 51, call 6 (H200): call 3 again with the landed form of the pacing (schedule the
# output, wait for the chunk's queries: the layer before), no switch.
source benchmarks/install_on_device.sh >/dev/null 2>&1
VQ_MEMORY_LIMIT_GB=60 python3 benchmarks/decode.py --preset llama3-8b \
  --contexts 4096 32768 --methods "mlx-lm KVCache" kivi-4bit kitty --steps 4 --rounds 1 \
  --warmup-rounds 0 --prefill-repeats 2 --budget-s 250 --out $OUT/decode_wait_queries.json > $OUT/decode_wait_queries.log 2>&1
grep -A8 "^| context" $OUT/decode_wait_queries.log
