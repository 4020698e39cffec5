#!/bin/bash
# Session 71, after the c1 and c2 calls (carry [".device/c3"]), about 220 s: H2O's mass tests
# on the GPU (the float16 cases pinned to the float32 read since 40320ee), then decode.py's
# host and device time per step for composed storage's CUDA read beside snapkv alone and
# KVCache, in one process.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/c3/*.whl 2>/dev/null
MLX_DEFAULT_DEVICE=gpu timeout 45 python3 -m pytest -q -p no:cacheprovider --no-header -rfE \
  tests/test_quantized_slots_decode_read.py -k "h2o or on_cuda" > $OUT/h2o_tests_cuda.log 2>&1
echo "pytest rc=$? after ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/h2o_tests_cuda.log | cut -c1-300 | head -6
export VQ_MEMORY_LIMIT_GB=100
timeout $(( 215 - SECONDS )) python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 \
  --methods "mlx-lm KVCache" "snapkv 2048" "snapkv 2048 + kivi-4bit" "h2o 2048 + kivi-2bit" \
  --steps 16 --rounds 4 --prefill-repeats 1 --out $OUT/composed_decode.json > $OUT/composed_decode.log 2>&1
echo "decode rc=$? after ${SECONDS}s"; grep -E "^\| (cache|4096)" $OUT/composed_decode.log | cut -c1-400
true
