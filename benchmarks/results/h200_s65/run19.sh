source benchmarks/install_on_device.sh >/dev/null 2>&1
# Issue 30 (session 65): the decode-read tests on CUDA, one file at a time, so that each
# file's failures are written out even if the call runs out of time (session 65 ran them in
# one pytest process: 129 of 278 results in 300 s, and no summary). Carry [".device/c3"]
# after the c1 and c2 calls (results/h200_s63/README.md). FILES and PER_FILE_S as needed.
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/c3/*.whl 2>/dev/null
# MLX's CUDA back-end runs float32 matrix products in TF32 unless MLX_ENABLE_TF32=0
# (backend/cuda/gemms/cublas_gemm.cpp): the tests' bounds are float32's
export MLX_DEFAULT_DEVICE=gpu MLX_PTX_CACHE_DIR=/tmp/ptx MLX_ENABLE_TF32=${MLX_ENABLE_TF32:-0}
for f in ${FILES:-tests/test_kitty_decode_read.py tests/test_skvq_decode_read.py tests/test_cachegen_decode_read.py \
                   tests/test_anchorkv_decode_read.py tests/test_amc_decode_read.py tests/test_a2ats_decode_read.py}; do
  log=$OUT/$(basename $f .py).log
  # -v names each test as it ends; the first three failures' tracebacks come before the time runs out
  timeout ${PER_FILE_S:-90} python3 -m pytest -v --tb=short --maxfail=3 -p no:cacheprovider --no-header $f > $log 2>&1
  echo "$f rc=$? after ${SECONDS}s"; grep -E "FAILED|^E |passed|failed" $log | cut -c1-300 | head -16
  [ $SECONDS -gt 540 ] && break
done
