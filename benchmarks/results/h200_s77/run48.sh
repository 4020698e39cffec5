#!/bin/bash
# Session 77 (issue 30): where spectral's decode step spends its device time now (0.06x
# KVCache at 4k in call 5), kernel by kernel under ncu, beside KVCache and turboquant
# (notes/decode_kernels.md's table, last measured for spectral in session 45, before its
# word-unpacking and QJL fixes). 2 layers of the 8B shape, 4k, 36 warm steps, 4 captured.
# After the c1 and c2 calls, carry [".device/c3"].
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
export VQ_MEMORY_LIMIT_GB=100
which ncu || { echo "no ncu on this machine"; exit 0; }
for m in ${METHODS:-mlx-lm_KVCache spectral turboquant}; do  # one process a method: a timeout ends only its own
  python3 benchmarks/decode_kernels.py --out-dir $OUT/kernels --timeout ${PER_S:-140} --layers 2 --warm 36 --steps 4 \
    --methods "${m//_/ }" >> $OUT/kernels.log 2>&1
  echo "$m rc=$? after ${SECONDS}s"
done
python3 benchmarks/decode_kernels.py --report $OUT/kernels --top 10 | tee $OUT/kernels.md
true
