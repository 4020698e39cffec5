#!/bin/bash
# Session 51, call 1 (H200): spectral after the blocked history softmax (32k, 128k), and the
# quantized stores' prefill with and without evaluating each layer's attention output
# (VQ_PREFILL_EVAL: "" lazy, as before; "eval"; "async"), each process alone on its
# memory limit; then the three modes one after another at 32k for their times.
source benchmarks/install_on_device.sh >/dev/null 2>&1
LP="python3 benchmarks/long_prefill.py --preset llama3-8b --layers 4"
(VQ_MEMORY_LIMIT_GB=40 $LP --contexts 32768 131072 --methods spectral --method-timeout-s 280 \
   --out $OUT/spectral.json > $OUT/spectral.log 2>&1) &
for mode in lazy eval async; do
  (VQ_PREFILL_EVAL=$mode VQ_MEMORY_LIMIT_GB=24 $LP --contexts 131072 --methods kitty kivi \
     --method-timeout-s 200 --out $OUT/q128k_$mode.json > $OUT/q128k_$mode.log 2>&1) &
done
wait
for mode in lazy eval async; do
  VQ_PREFILL_EVAL=$mode VQ_MEMORY_LIMIT_GB=24 $LP --contexts 32768 --methods kitty kivi \
     --method-timeout-s 100 --out $OUT/q32k_$mode.json > $OUT/q32k_$mode.log 2>&1
done
tail -n 8 $OUT/*.log
