#!/bin/bash
# Session 70: (1) the four row kernels' emulation tests with the static_cast fill (GCC 13);
# (2) kvtc's leaderboard part, which died twice without a message (lb_subword_4k_s70), run
# alone under faulthandler; (3) composed storage's decode before (7c026ce's four files,
# carried in .device/before2) and after (tokens packed a ring at a time, h2o's mass from
# attention's weights), each process beside its own KVCache. After the c1 and c2 calls,
# carry [".device/c3", ".device/before2"]; about 400 s.
source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=100
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/c3/*.whl 2>/dev/null
MLX_DEFAULT_DEVICE=gpu MLX_ENABLE_TF32=0 timeout 150 python3 -m pytest -q -p no:cacheprovider --no-header -rfE \
  tests/test_codebook_rows_kernel.py tests/test_nsnquant_code_rows_kernel.py \
  tests/test_adakv_plane_rows_kernel.py tests/test_kitty_key_rows_kernel.py > $OUT/row_kernels_cuda.log 2>&1
echo "pytest rc=$? after ${SECONDS}s"; grep -E "^FAILED|^ERROR|passed|failed" $OUT/row_kernels_cuda.log | cut -c1-300 | head -12
timeout 150 python3 -X faulthandler -c "import sys; from veloxquant_mlx.cli import main; sys.exit(main(sys.argv[1:]))" \
  bench --leaderboard --model reference-subword --methods kvtc --ratios 0.25 --tasks niah_single \
  --context 4096 --examples 1 --out /tmp/kvtc_probe --force > $OUT/kvtc_probe.log 2>&1
echo "kvtc probe exit $? after ${SECONDS}s"; grep -v "^  File.*site-packages" $OUT/kvtc_probe.log | tail -25 | cut -c1-300
rm -rf shim_old && cp -r shim shim_old && cp .device/before2/{quantized_slots,base,store}.py shim_old/veloxquant_mlx/evict/ &&
  cp .device/before2/h2o.py shim_old/veloxquant_mlx/methods/
for tree in shim_old shim; do
  PYTHONPATH=/tmp/site:$PWD/$tree timeout $(( (590 - SECONDS) / 2 )) python3 benchmarks/decode.py --preset llama3-8b \
    --contexts 4096 --methods "mlx-lm KVCache" "snapkv 2048" "snapkv 2048 + kivi-4bit" "tova 2048 + kivi-4bit" \
    "h2o 2048 + kivi-2bit" --steps 16 --rounds 4 --prefill-repeats 1 --out $OUT/composed_$tree.json > $OUT/composed_$tree.log 2>&1
  echo "decode $tree rc=$? after ${SECONDS}s"; grep "^| 4096" $OUT/composed_$tree.log | cut -d'|' -f3,5,11,12,13,14
done
true
