#!/bin/bash
# Session 71, one call after the c1 and c2 wheel calls (carry [".device/c3"]), about 590 s.
# First, side by side for at most 330 s:
# (1) kvtc's leaderboard row (its part died on CUDA in s70 before f019f4a), one process;
# (2) the question-after leaderboard of the 16 eviction methods at the four ratios, 8
#     processes (a part cut short is merged as far as it got; a later call resumes);
# (3) the four row kernels' tests (CUDA and the emulation) with a longer limit than
#     run27.sh's 150 s, and composed storage's tests on the GPU.
# Then alone on the GPU: composed storage's CUDA read (QuantizedSlots._attend_rows) against
# the float32 read, in one process (read_ab.py --switch composed-rows), at 4k, then at 32k
# in what time is left. The parts come back as one archive; the logs as files.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/c3/*.whl 2>/dev/null
bench() { timeout 330 python3 -c "import sys; from veloxquant_mlx.cli import main; sys.exit(main(sys.argv[1:]))" \
  bench --leaderboard --model reference-subword --context 4096 --examples 5 --force "$@"; }
bench --methods kvtc --jobs 1 --out lb_kvtc > $OUT/lb_kvtc.log 2>&1 &
kvtc=$!
(MLX_DEFAULT_DEVICE=gpu MLX_ENABLE_TF32=0 timeout 320 python3 -m pytest -q -p no:cacheprovider --no-header -rfE \
  tests/test_quantized_slots_decode_read.py tests/test_codebook_rows_kernel.py tests/test_nsnquant_code_rows_kernel.py \
  tests/test_adakv_plane_rows_kernel.py tests/test_kitty_key_rows_kernel.py > $OUT/kernel_tests_cuda.log 2>&1) &
tests=$!
bench --question-after --jobs 8 --out lb_qa \
  --methods knorm,qfilters,keyformer,tova,h2o,streaming_llm,snapkv,kvzip,chunkkv,pyramidkv,curdkv,nestedkv,rocketkv,squeeze,cam,morphkv \
  > $OUT/lb_qa.log 2>&1
echo "question-after leaderboard rc=$? after ${SECONDS}s"
wait $kvtc; echo "kvtc leaderboard rc=$? after ${SECONDS}s"
wait $tests; echo "tests rc=$? after ${SECONDS}s"
grep -E "^FAILED|^ERROR|passed|failed" $OUT/kernel_tests_cuda.log | cut -c1-300 | head -12
tail -n 2 $OUT/lb_kvtc.log $OUT/lb_qa.log | cut -c1-300
tar czf "$OUT/leaderboards.tgz" lb_kvtc lb_qa
export VQ_MEMORY_LIMIT_GB=100
composed=("snapkv 2048 + kivi-4bit" "tova 2048 + kivi-4bit" "h2o 2048 + kivi-2bit")
timeout $(( 500 - SECONDS )) python3 benchmarks/read_ab.py --switch composed-rows --preset llama3-8b --context 4096 \
  --methods "${composed[@]}" --steps 16 --rounds 6 > $OUT/composed_4k.log 2>&1
echo "4k rc=$? after ${SECONDS}s"; tail -7 $OUT/composed_4k.log
timeout $(( 588 - SECONDS )) python3 benchmarks/read_ab.py --switch composed-rows --preset llama3-8b --context 32768 \
  --methods "${composed[@]:0:1}" "${composed[@]:2:1}" --steps 16 --rounds 3 > $OUT/composed_32k.log 2>&1
echo "32k rc=$? after ${SECONDS}s"; tail -6 $OUT/composed_32k.log
true
