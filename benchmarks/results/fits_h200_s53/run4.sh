#!/bin/bash
# Session 53, run 4 (a fresh machine): host_eigh spreads a batch of eigenproblems over CPU
# streams while the device is the GPU, and palu's keys' and values' fits are evaluated
# together (4 problems of 512 side by side). One 8B layer's prefill (gear, palu, kivi),
# then the whole 8B shape for palu at 4k and 32k (session 51: 20.3x and 6.55x), then an
# ncu profile of gear's decode step at 32k (2 layers; its device time was 50 ms a step
# against KVCache's 5 in run 3).
source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=100
python3 benchmarks/prefill_layer.py --context 4096 --chunk 2048 --methods gear palu kivi \
  --out $OUT/prefill_layer_4k_run4.json > $OUT/prefill_layer_4k_run4.log 2>&1
VQ_MEMORY_LIMIT_GB=60 python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 32768 \
  --methods "mlx-lm KVCache" palu --steps 4 --rounds 1 \
  --warmup-rounds 0 --prefill-repeats 1 --budget-s 330 --out $OUT/decode_palu.json > $OUT/decode_palu.log 2>&1
timeout 240 python3 benchmarks/decode_kernels.py --out-dir /tmp/kernels --timeout 200 --layers 2 --context 32768 \
  --warm 36 --steps 4 --methods "mlx-lm KVCache" gear > $OUT/decode_kernels_gear_32k.log 2>&1
python3 benchmarks/decode_kernels.py --report /tmp/kernels --top 12 >> $OUT/decode_kernels_gear_32k.log 2>&1
tail -n 12 $OUT/prefill_layer_4k_run4.log
grep -A6 "^| context" $OUT/decode_palu.log
tail -n 8 $OUT/decode_kernels_gear_32k.log
