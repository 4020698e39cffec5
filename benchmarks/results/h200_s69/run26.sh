#!/bin/bash
# Session 69 (issue 30): the four row kernels off and on, alternated in one process
# (benchmarks/row_kernels_ab.py, now read_ab.py), where run24.sh timed them in separate processes whose
# baselines differed by 2x. After the c1 and c2 calls, carry [".device/c3"]; about 200 s.
# TESTS=1 first reruns the kernels' tests with 9059d9f's fixes (up to 240 s).
source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=100
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/c3/*.whl 2>/dev/null
if [ "${TESTS:-0}" = 1 ]; then
  MLX_DEFAULT_DEVICE=gpu MLX_ENABLE_TF32=0 timeout 240 python3 -m pytest -q -p no:cacheprovider --no-header -rfE \
    tests/test_codebook_rows_kernel.py tests/test_nsnquant_code_rows_kernel.py \
    tests/test_adakv_plane_rows_kernel.py tests/test_kitty_key_rows_kernel.py > $OUT/row_kernels_cuda.log 2>&1
  echo "pytest rc=$? after ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/row_kernels_cuda.log | cut -c1-300 | head -12
fi
timeout $((590 - SECONDS)) python3 benchmarks/read_ab.py --preset llama3-8b --context 4096 \
  --methods ${METHODS:-vecinfer nsnquant adakv kitty} --steps 16 --rounds 6 > $OUT/row_kernels_ab_4k.log 2>&1
echo "row_kernels_ab rc=$?"; grep "^|\|KVCache" $OUT/row_kernels_ab_4k.log | cut -c1-300
grep -A3 Traceback $OUT/row_kernels_ab_4k.log | tail -4
true
