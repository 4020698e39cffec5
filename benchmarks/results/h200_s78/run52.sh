#!/bin/bash
# Session 78 (issue 30): which other quantizers' decode steps launch a kernel with a
# thread-block cluster taller than 1 in y or z (MLX then instantiates the step's graph at
# every commit; notes/cuda_graphs.md). decode_kernels.py records each kernel's cluster since
# session 77; only spectral and KVCache ran with it. 2 layers of the 8B shape, 4k, 36 warm
# steps, 4 captured. After the c1 and c2 calls, carry [".device/c3"].
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
export VQ_MEMORY_LIMIT_GB=100
for m in ${METHODS:-cachegen gear zipcache palu svdq turboquant}; do  # one process a method
  python3 benchmarks/decode_kernels.py --out-dir $OUT/kernels --prewarm --timeout ${PER_S:-200} --layers 2 --warm 36 --steps 4 \
    --methods "${m//_/ }" >> $OUT/kernels.log 2>&1
  echo "$m rc=$? after ${SECONDS}s"
done
python3 benchmarks/decode_kernels.py --report $OUT/kernels --top 6 | tee $OUT/kernels.md
true
