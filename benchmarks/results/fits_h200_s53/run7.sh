#!/bin/bash
# Session 53, run 7 (a fresh machine): gear's low-rank read as one product per group of
# tokens (no (R, T, r) gather and sum): its reader against attention over the dequantized
# history at 32k, the whole 8B shape's decode at 4k and 32k (run 3: 0.26x and 0.12x,
# device 17.0 and 49.6 ms a step), and ncu at 32k (run 4: 1,958 us a layer).
source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=100
python3 benchmarks/check_gear_reader.py --context 32768 > $OUT/check_gear_reader_32k.log 2>&1
echo "rc $?" >> $OUT/check_gear_reader_32k.log
VQ_MEMORY_LIMIT_GB=60 python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 32768 \
  --methods "mlx-lm KVCache" gear --steps 8 --rounds 2 \
  --warmup-rounds 1 --prefill-repeats 1 --budget-s 200 --out $OUT/decode_gear_run7.json > $OUT/decode_gear_run7.log 2>&1
timeout 200 python3 benchmarks/decode_kernels.py --out-dir /tmp/kernels --timeout 180 --layers 2 --context 32768 \
  --warm 36 --steps 4 --methods gear > $OUT/decode_kernels_gear_32k_run7.log 2>&1
python3 benchmarks/decode_kernels.py --report /tmp/kernels --top 12 >> $OUT/decode_kernels_gear_32k_run7.log 2>&1
cat $OUT/check_gear_reader_32k.log
grep -A6 "^| context" $OUT/decode_gear_run7.log
tail -n 3 $OUT/decode_kernels_gear_32k_run7.log
