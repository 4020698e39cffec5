#!/bin/bash
# Session 68 (issue 30): the coded rows of vecinfer (kernels/codebook_rows.py) and nsnquant
# (methods/nsnquant/kernel.py) in one launch a tensor, AdaKV's stored rows from its planes in
# one (methods/adakv/kernel.py), kitty's stored keys from its two planes in one
# (methods/kitty/kernel.py). After the c1 and c2 calls, carry [".device/c3"]; two calls:
# METHODS="vecinfer nsnquant", then METHODS="adakv kitty" (each about 400 s).
# 1. the kernels' tests on the GPU (the first call only: TESTS=1);
# 2. decode at 4k, 8B shape, each method in its own process beside its own KVCache, with the
#    kernels switched off (VQ_NO_ROW_KERNELS=1: the MLX ops, as before) and on.
source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=100
printf 'import os\nif os.environ.get("VQ_NO_ROW_KERNELS") == "1":\n    import veloxquant_mlx.kernels.codebook_rows as _c\n    import veloxquant_mlx.methods.nsnquant.kernel as _n\n    import veloxquant_mlx.methods.adakv.kernel as _a\n    import veloxquant_mlx.methods.kitty.kernel as _k\n    _c.kernel_checked = _n.kernel_checked = _a.kernel_checked = _k.kernel_checked = lambda *a: False\n' >> shim/sitecustomize.py
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/c3/*.whl 2>/dev/null
if [ "${TESTS:-0}" = 1 ]; then
  MLX_DEFAULT_DEVICE=gpu MLX_ENABLE_TF32=0 timeout 150 python3 -m pytest -q -p no:cacheprovider --no-header \
    tests/test_codebook_rows_kernel.py tests/test_nsnquant_code_rows_kernel.py \
    tests/test_adakv_plane_rows_kernel.py tests/test_kitty_key_rows_kernel.py > $OUT/row_kernels_cuda.log 2>&1
  echo "pytest rc=$? after ${SECONDS}s"; grep -E "FAILED|passed|failed" $OUT/row_kernels_cuda.log | cut -c1-300 | head -8
fi
for off in 1 0; do
  [ $SECONDS -gt 300 ] && break
  VQ_NO_ROW_KERNELS=$off timeout $((590 - SECONDS)) python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 \
    --isolate --steps 16 --rounds 2 --prefill-repeats 1 --budget-s 200 \
    --methods "mlx-lm KVCache" ${METHODS:-vecinfer nsnquant} --out $OUT/decode_4k_rows_off$off.json \
    > $OUT/decode_4k_rows_off$off.log 2>&1
  echo "VQ_NO_ROW_KERNELS=$off"; grep "^| 4096" $OUT/decode_4k_rows_off$off.log | cut -c1-300
  grep -A3 Traceback $OUT/decode_4k_rows_off$off.log | tail -4
done
true
