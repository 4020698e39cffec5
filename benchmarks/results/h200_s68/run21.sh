#!/bin/bash
# Session 68 (issue 31): the nearest-centroid kernel (kernels/nearest_centroid.py) on CUDA.
# After the c1 and c2 calls, carry [".device/c3"].
# 1. its tests on the GPU (TF32 off: the products' bounds are float32's);
# 2. warm prefill of 4,096 tokens, 8B shape, each method in its own process beside its own
#    KVCache: vecinfer and a2ats with the kernel switched off (VQ_NO_NEAREST_KERNEL=1: the products, as
#    before), then vecinfer, a2ats and nsnquant with it.
source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=100
printf 'import os\nif os.environ.get("VQ_NO_NEAREST_KERNEL") == "1":\n    import veloxquant_mlx.kernels.nearest_centroid as _n\n    _n.MAX_SUB_DIM = 0\n' >> shim/sitecustomize.py
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/c3/*.whl 2>/dev/null
MLX_DEFAULT_DEVICE=gpu MLX_ENABLE_TF32=0 timeout 150 python3 -m pytest -q -p no:cacheprovider --no-header \
  tests/test_nearest_centroid_kernel.py > $OUT/nearest_cuda.log 2>&1
echo "pytest rc=$? after ${SECONDS}s"; grep -E "FAILED|passed|failed" $OUT/nearest_cuda.log | cut -c1-300 | head -12
for spec in "1:vecinfer a2ats:90" "0:vecinfer a2ats nsnquant:150"; do
  IFS=: read off methods budget <<< "$spec"
  [ $SECONDS -gt 420 ] && break
  VQ_NO_NEAREST_KERNEL=$off timeout $((590 - SECONDS)) python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 \
    --isolate --steps 8 --rounds 1 --prefill-repeats 2 --budget-s $budget \
    --methods "mlx-lm KVCache" $methods --out $OUT/prefill_4k_off$off.json > $OUT/prefill_4k_off$off.log 2>&1
  echo "VQ_NO_NEAREST_KERNEL=$off"; grep "^|" $OUT/prefill_4k_off$off.log | cut -c1-300
  grep -A3 Traceback $OUT/prefill_4k_off$off.log | tail -4; grep -m2 "self-check" $OUT/prefill_4k_off$off.log
done
true
