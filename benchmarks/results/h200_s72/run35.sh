#!/bin/bash
# Session 72, after the c1 and c2 calls, carry [".device/c3"]; ends by itself within CALL_S
# (default 560) s. Whole-model prefill, each variant a process beside its own KVCache:
#  before: VQ_MASS_KERNEL=0 VQ_FIT_STREAMS=1 (MLX's ops for the prompt mass in blocks of
#          2^23 logits; one CPU stream for the fits, OpenBLAS's threads as installed);
#  after:  the defaults (the mass kernels in blocks of 2^25; the fits over the CPU streams,
#          kvtc's keys and values fitted together).
# h2o's rows move with the mass kernels only, kvtc's with the fit streams only.
# 4k: KVCache, h2o, h2o + kivi-2bit, kvtc; then 32k: KVCache and h2o, as time allows.
source benchmarks/install_on_device.sh >/dev/null 2>&1 || { echo "install failed"; exit 1; }
export VQ_MEMORY_LIMIT_GB=100
deadline=${CALL_S:-560}
run() {  # variant context limit methods...
  local variant=$1 context=$2 limit=$3; shift 3
  if [ $variant = before ]; then export VQ_MASS_KERNEL=0 VQ_FIT_STREAMS=1; else unset VQ_MASS_KERNEL VQ_FIT_STREAMS; fi
  timeout $limit python3 benchmarks/decode.py --preset llama3-8b --contexts $context --methods "$@" \
    --steps 2 --rounds 1 --prefill-repeats 1 --budget-s $(( limit - 50 )) \
    --out $OUT/prefill_${context}_$variant.json > $OUT/prefill_${context}_$variant.log 2>&1
  echo "$variant $context rc=$? after ${SECONDS}s"
  grep -E "^\| " $OUT/prefill_${context}_$variant.log | cut -d'|' -f3,6-10 | head -n 6
  grep -B2 -A4 Traceback $OUT/prefill_${context}_$variant.log | tail -n 6
}
for v in before after; do run $v 4096 130 "mlx-lm KVCache" h2o "h2o 2048 + kivi-2bit" kvtc; done
for v in before after; do
  left=$(( (deadline - SECONDS) / (v == before ? 2 : 1) ))
  [ $v = after ] && left=$(( deadline - SECONDS ))
  [ $left -gt 90 ] && run $v 32768 $left "mlx-lm KVCache" h2o
done
true
