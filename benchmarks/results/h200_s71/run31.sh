#!/bin/bash
# Queued for the next session (not run in session 71). After the c1 and c2 calls, carry
# [".device/c3"], about 450 s:
# (1) the slot-rows kernel's tests and composed storage's tests on the GPU (the kernel has
#     only been emulated; H2O's float16 cases were cut off in run 30);
# (2) the kernel against MLX's ops, in one process (read_ab.py --switch slot-rows-kernel);
# (3) decode.py's host and wall time a token with the kernel, beside snapkv alone.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/c3/*.whl 2>/dev/null
MLX_DEFAULT_DEVICE=gpu timeout 150 python3 -m pytest -q -p no:cacheprovider --no-header -rfE \
  tests/test_slot_rows_kernel.py tests/test_quantized_slots_decode_read.py > $OUT/slot_rows_tests_cuda.log 2>&1
echo "pytest rc=$? after ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/slot_rows_tests_cuda.log | cut -c1-300 | head -8
export VQ_MEMORY_LIMIT_GB=100
composed=("snapkv 2048 + kivi-4bit" "tova 2048 + kivi-4bit" "h2o 2048 + kivi-2bit")
timeout $(( 330 - SECONDS )) python3 benchmarks/read_ab.py --switch slot-rows-kernel --preset llama3-8b --context 4096 \
  --methods "${composed[@]}" --steps 16 --rounds 6 > $OUT/slot_rows_4k.log 2>&1
echo "kernel A/B rc=$? after ${SECONDS}s"; tail -n 6 $OUT/slot_rows_4k.log
timeout $(( 585 - SECONDS )) python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 \
  --methods "mlx-lm KVCache" "snapkv 2048" "${composed[@]}" \
  --steps 16 --rounds 4 --prefill-repeats 1 --out $OUT/composed_decode.json > $OUT/composed_decode.log 2>&1
echo "decode rc=$? after ${SECONDS}s"; grep -E "^\| (cache|4096)" $OUT/composed_decode.log | cut -c1-400
true
