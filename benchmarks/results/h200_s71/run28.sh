#!/bin/bash
# Session 71, one call after the c1 and c2 wheel calls (carry [".device/c3"]), about 560 s:
# (1) kvtc's leaderboard row (its part died on CUDA in s70 before f019f4a), one process;
# (2) the question-after leaderboard of the 16 eviction methods at the four ratios, 8
#     processes, beside (1);
# (3) the four row kernels' tests (CUDA and the emulation) with a longer limit than
#     run27.sh's 150 s, beside both.
# The parts come back as one archive; the logs as files.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/c3/*.whl 2>/dev/null
bench() { timeout 540 python3 -c "import sys; from veloxquant_mlx.cli import main; sys.exit(main(sys.argv[1:]))" \
  bench --leaderboard --model reference-subword --context 4096 --examples 5 --force "$@"; }
bench --methods kvtc --jobs 1 --out lb_kvtc > $OUT/lb_kvtc.log 2>&1 &
kvtc=$!
MLX_DEFAULT_DEVICE=gpu MLX_ENABLE_TF32=0 timeout 540 python3 -m pytest -q -p no:cacheprovider --no-header -rfE \
  tests/test_codebook_rows_kernel.py tests/test_nsnquant_code_rows_kernel.py \
  tests/test_adakv_plane_rows_kernel.py tests/test_kitty_key_rows_kernel.py > $OUT/row_kernels_cuda.log 2>&1 &
tests=$!
bench --question-after --jobs 8 --out lb_qa \
  --methods knorm,qfilters,keyformer,tova,h2o,streaming_llm,snapkv,kvzip,chunkkv,pyramidkv,curdkv,nestedkv,rocketkv,squeeze,cam,morphkv \
  > $OUT/lb_qa.log 2>&1
echo "question-after leaderboard rc=$? after ${SECONDS}s"
wait $kvtc; echo "kvtc leaderboard rc=$? after ${SECONDS}s"
wait $tests; echo "row kernel tests rc=$? after ${SECONDS}s"
grep -E "^FAILED|^ERROR|passed|failed" $OUT/row_kernels_cuda.log | cut -c1-300 | head -12
tail -3 $OUT/lb_kvtc.log $OUT/lb_qa.log | cut -c1-300
tar czf "$OUT/leaderboards.tgz" lb_kvtc lb_qa
ls -la "$OUT"
