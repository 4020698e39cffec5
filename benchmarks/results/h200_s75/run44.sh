#!/bin/bash
# Session 75: h2o's peak at 4k (1.88x KVCache's in run42's call, h2o 2048 + kivi-2bit 1.89x,
# h2o 2048 0.91; 0.62-0.76 before session 72's prompt-mass kernels), the kernels switched
# off (VQ_MASS_KERNEL=0: MLX's ops, 2^23 logits a block) against the default (2^25 a block),
# each in its own process beside its own KVCache. After the c1 and c2 calls, carry
# [".device/c3"]; ends within CALL_S (default 400) s.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
export VQ_MEMORY_LIMIT_GB=100
deadline=${CALL_S:-400}
for v in 0 1; do
  left=$(( (deadline - SECONDS - 10) / (v == 0 ? 2 : 1) ))
  [ $left -lt 60 ] && break
  VQ_MASS_KERNEL=$v timeout $left python3 benchmarks/decode.py --preset llama3-8b --contexts 4096 --isolate \
    --methods "mlx-lm KVCache" h2o "h2o 2048" "h2o 2048 + kivi-2bit" --steps 2 --rounds 1 --prefill-repeats 2 \
    --budget-s $(( left - 30 )) --out $OUT/h2o_peak_mass$v.json > $OUT/h2o_peak_mass$v.log 2>&1
  echo "VQ_MASS_KERNEL=$v rc=$? after ${SECONDS}s"
  grep -E "^\| " $OUT/h2o_peak_mass$v.log | cut -d'|' -f3,6,7,9,10 | tail -n 3
done
true
