#!/bin/bash
# Session 72, after the c1 and c2 calls, carry [".device/c3"]; at most 590 s:
# (1) the prompt-mass kernels (evict/mass_kernel.py, emulated only so far) on the GPU: their
#     tests, then benchmarks/prompt_mass.py against MLX's ops at 4k;
# (2) issue 31's prefill table at 4k: every method at its defaults in one process beside one
#     KVCache, warm prefill (--prefill-repeats 1) and the first call apart, peaks, then a short
#     decode so the table is decode.py's. The last full table was session 67's.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/c3/*.whl 2>/dev/null
MLX_DEFAULT_DEVICE=gpu timeout 110 python3 -m pytest -q -p no:cacheprovider --no-header -rfE tests/test_mass_kernel.py \
  > $OUT/mass_kernel_tests_cuda.log 2>&1
echo "pytest rc=$? after ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/mass_kernel_tests_cuda.log | cut -c1-300 | head -6
timeout 70 python3 benchmarks/prompt_mass.py --context 4096 --chunk 2048 --repeats 5 --only "MLX ops" "mass kernels" \
  > $OUT/prompt_mass_4k.log 2>&1
echo "prompt_mass rc=$? after ${SECONDS}s"; grep "^|" $OUT/prompt_mass_4k.log
export VQ_MEMORY_LIMIT_GB=100
left=$(( 585 - SECONDS ))
timeout $left python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 --methods all \
  --steps 2 --rounds 1 --prefill-repeats 1 --budget-s ${BUDGET_S:-$(( left - 170 ))} \
  --out $OUT/prefill_4k_all.json > $OUT/prefill_4k_all.log 2>&1
echo "decode rc=$? after ${SECONDS}s"; grep -E "^\| " $OUT/prefill_4k_all.log | cut -d'|' -f3,5-10 | tail -n 60
grep -B2 -A4 Traceback $OUT/prefill_4k_all.log | tail -n 12
true
