#!/bin/bash
# Session 68 (issue 31), for the next device: the Jacobi eigensolver (kernels/jacobi_eigh.py).
# After the c1 and c2 calls, carry [".device/c3"].
# 1. its tests on the GPU, then benchmarks/gpu_eigh.py: the kernel against the CPU stream's
#    eigh at the fits' sizes;
# 2. warm prefill of 4,096 tokens, 8B shape, each method in its own process beside its own
#    KVCache, with the kernel off (GPU_MAX_N=0, as landed) and on for n <= 512
#    (VQ_GPU_EIGH_MAX_N=512): palu, svdq, amc.
source benchmarks/install_on_device.sh >/dev/null 2>&1
export VQ_MEMORY_LIMIT_GB=100
printf 'import os\nif os.environ.get("VQ_GPU_EIGH_MAX_N"):\n    import veloxquant_mlx.kernels.jacobi_eigh as _j\n    _j.GPU_MAX_N = int(os.environ["VQ_GPU_EIGH_MAX_N"])\n' >> shim/sitecustomize.py
python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/c3/*.whl 2>/dev/null
MLX_DEFAULT_DEVICE=gpu timeout 120 python3 -m pytest -q -p no:cacheprovider --no-header \
  tests/test_jacobi_eigh_kernel.py > $OUT/jacobi_cuda.log 2>&1
echo "pytest rc=$? after ${SECONDS}s"; grep -E "FAILED|passed|failed" $OUT/jacobi_cuda.log | cut -c1-300 | head -8
timeout 120 python3 benchmarks/gpu_eigh.py > $OUT/gpu_eigh.log 2>&1; cat $OUT/gpu_eigh.log | tail -8
for max_n in 0 512; do
  [ $SECONDS -gt 400 ] && break
  VQ_GPU_EIGH_MAX_N=$max_n timeout $((590 - SECONDS)) python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 \
    --isolate --steps 8 --rounds 1 --prefill-repeats 2 --budget-s 100 \
    --methods "mlx-lm KVCache" palu svdq amc --out $OUT/prefill_4k_eigh$max_n.json > $OUT/prefill_4k_eigh$max_n.log 2>&1
  echo "VQ_GPU_EIGH_MAX_N=$max_n"; grep "^| 4096" $OUT/prefill_4k_eigh$max_n.log | cut -c1-300
  grep -A3 Traceback $OUT/prefill_4k_eigh$max_n.log | tail -4
done
true
